"""The `remote` reward against a real local HTTP server: scores, components, retries, timeouts, bad answers."""

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rewards.remote import RemoteRewardError, remote_reward
from rewards.worker import RewardWorker


class _Handler(BaseHTTPRequestHandler):
    """Routes by path: /score (1.0 when completion == answer), /components, /flaky (503 on the first request),
    /slow (sleeps 1 s), /reject (400), /garbage (not JSON), /wrong (JSON without a reward)."""

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            srv.hits[self.path] += 1
            n = srv.hits[self.path]
        if self.path == "/score":
            self._send(200, {"reward": float(body["completion"] == body["metadata"]["answer"])})
        elif self.path == "/components":
            self._send(200, {"rewards": {"correct": 1.0, "len": -len(body["completion"]) / 10}})
        elif self.path == "/flaky":
            self._send(503, {"error": "busy"}) if n == 1 else self._send(200, {"reward": 0.5})
        elif self.path == "/slow":
            time.sleep(1.0)
            self._send(200, {"reward": 1.0})
        elif self.path == "/reject":
            self._send(400, {"error": "bad request"})
        elif self.path == "/garbage":
            self._send(200, None, raw=b"<html>oops</html>")
        else:
            self._send(200, {"score": 1.0})

    def _send(self, code, obj, raw=None):
        data = raw if raw is not None else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.hits, srv.lock = Counter(), threading.Lock()
    srv.base = f"http://127.0.0.1:{srv.server_address[1]}"
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_scores_and_components(server):
    meta = {"answer": "42"}
    assert remote_reward("6*7=", "42", meta, url=server.base + "/score") == 1.0
    assert remote_reward("6*7=", "41", meta, url=server.base + "/score") == 0.0
    assert remote_reward("p", "abcde", meta, url=server.base + "/components") == {"correct": 1.0, "len": -0.5}
    assert server.hits["/score"] == 2


def test_retries_after_503_then_succeeds(server):
    assert remote_reward("p", "c", {}, url=server.base + "/flaky", retries=2, backoff_s=0.01) == 0.5
    assert server.hits["/flaky"] == 2


def test_retries_exhausted_names_the_last_error(server):
    with pytest.raises(RemoteRewardError, match=r"giving up after 1 attempt\(s\); last: HTTP 503"):
        remote_reward("p", "c", {}, url=server.base + "/flaky", retries=0)


def test_slow_handler_times_out_each_attempt(server):
    t0 = time.perf_counter()
    with pytest.raises(RemoteRewardError, match=r"giving up after 2 attempt\(s\); last: timed out after 0.2s"):
        remote_reward("p", "c", {}, url=server.base + "/slow", timeout_s=0.2, retries=1, backoff_s=0.01)
    assert time.perf_counter() - t0 < 0.9  # two 0.2 s attempts, not the handler's 1 s
    assert server.hits["/slow"] == 2


def test_4xx_is_not_retried(server):
    with pytest.raises(RemoteRewardError, match=r"HTTP 400 \(not retried\)"):
        remote_reward("p", "c", {}, url=server.base + "/reject", retries=3, backoff_s=0.01)
    assert server.hits["/reject"] == 1


def test_connection_refused_is_retried_then_fails(server):
    url = server.base + "/score"
    server.shutdown()
    server.server_close()
    with pytest.raises(RemoteRewardError, match=r"giving up after 3 attempt\(s\); last: ConnectError"):
        remote_reward("p", "c", {}, url=url, retries=2, backoff_s=0.01)


@pytest.mark.parametrize("path,msg", [("/garbage", "response is not JSON"), ("/wrong", r"expected \{\"reward\"")])
def test_bad_response_is_a_clear_error(server, path, msg):
    with pytest.raises(RemoteRewardError, match=msg):
        remote_reward("p", "c", {}, url=server.base + path)


def test_missing_url():
    with pytest.raises(RemoteRewardError, match="needs params.url"):
        remote_reward("p", "c", {})


def test_through_the_reward_worker(server):
    """Concurrent scoring through the worker; a failing service scores 0 and is counted, not fatal."""
    good = RewardWorker(specs=[("remote", 2.0, {"url": server.base + "/score"})], timeout_s=5.0, strict=False)
    items = [("p", str(i), {"answer": "3"}) for i in range(8)]
    results, errors, *_ = good.score(items)
    assert errors == 0 and [r.reward for r in results] == [2.0 * (i == 3) for i in range(8)]
    assert results[3].components == {"remote": 1.0}

    comps = RewardWorker(specs=[("remote", 1.0, {"url": server.base + "/components"})], timeout_s=5.0, strict=False)
    (res,), *_ = comps.score([("p", "ab", {})])
    assert res.components == {"remote/correct": 1.0, "remote/len": -0.2} and res.reward == pytest.approx(0.8)

    bad = RewardWorker(specs=[("remote", 1.0, {"url": server.base + "/reject"})], timeout_s=5.0, strict=False)
    results, errors, *_ = bad.score(items[:3])
    assert errors == 3 and bad.errors == 3 and all(r.reward == 0.0 for r in results)
