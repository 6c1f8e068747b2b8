"""Partial rollouts on a real vLLM engine (workers/stream.py): a weight push in the middle of generation
loses and regenerates no token, the tokens before it keep their logprobs and version, the tokens after it are the
new weights' (each checked against transformers on the exact prefix, fp32), and a resumed sample's budget is what
remained of its own."""

import json
import shutil
import subprocess
import sys
import textwrap
from functools import cache

import pytest
import torch

from tests.conftest import subprocess_env
from tests.test_e2e import ROOT

BUDGET, STEPS_BEFORE_PUSH = 20, 6

DRIVER = textwrap.dedent(f"""
    import json, os, sys
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from workers.stream import Stream

    if __name__ == "__main__":
        base, other, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        llm = LLM(model=base, dtype="float32", enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=2**27,
                  seed=0, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                  enable_chunked_prefill=False, max_num_batched_tokens=4096,  # as the rollout actors run it
                  worker_extension_cls="workers.nccl_sync.NcclWeightSyncExtension")
        stream = Stream(llm.llm_engine, lambda n, seed: SamplingParams(max_tokens=n, temperature=1.0, logprobs=0,
                                                                       seed=seed, ignore_eos=True))
        for i, ids in enumerate(prompts):
            stream.submit(f"p{{i}}", ids, {BUDGET}, seed=i)
        done = []
        for _ in range({STEPS_BEFORE_PUSH}):
            done += stream.step()
        weights = load_file(os.path.join(other, "model.safetensors"))

        def load():
            llm.collective_rpc("fleetrl_reload_weights", args=(iter(weights.items()),))
            llm.reset_prefix_cache()

        info = stream.push(load, 1)
        stream.submit("late", prompts[0], {BUDGET}, seed=99)  # sent after the push: the new weights' alone
        while stream.in_flight:
            done += stream.step()
        print("RESULT", json.dumps({{"push": info, "samples": [vars(p) for p in done]}}))
""")


def _perturbed_copy(src, out):
    """The embedded model with every weight moved by seeded noise: another policy, same shapes and tokenizer."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    g = torch.Generator().manual_seed(0)
    weights = load_file(src / "model.safetensors")
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()},
              out / "model.safetensors")
    return out


@cache
def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logprobs(path, prompt_ids, token_ids) -> list[float]:
    with torch.no_grad():
        logits = _model(str(path))(torch.tensor([prompt_ids + token_ids])).logits[0].log_softmax(-1)
    return [logits[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(token_ids)]


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_a_push_mid_generation_keeps_every_token_and_the_new_weights_sample_the_rest(tmp_path, embedded_model):
    from transformers import AutoTokenizer

    other = _perturbed_copy(embedded_model, tmp_path / "other")
    tok = AutoTokenizer.from_pretrained(embedded_model)
    prompts = [tok(t)["input_ids"] for t in ("12+34=", "7+58=", "99+1=", "40+40=")]
    r = subprocess.run([sys.executable, "-c", DRIVER, str(embedded_model), str(other), json.dumps(prompts)],
                       cwd=ROOT, env=subprocess_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                       timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-4000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["push"]["resubmitted"] == len(prompts) and out["push"]["version"] == 1
    samples = {s["uid"]: s for s in out["samples"]}
    assert sorted(samples) == sorted([f"p{i}" for i in range(len(prompts))] + ["late"])
    moved = 0.0
    for uid, s in samples.items():
        # the whole budget, once: nothing lost at the push and nothing granted again
        assert len(s["token_ids"]) == len(s["logprobs"]) == len(s["versions"]) == BUDGET
        assert s["finish_reason"] == "length"
        before = s["versions"].count(0)
        assert s["versions"] == [0] * before + [1] * (BUDGET - before)
        if uid == "late":
            assert before == 0 and s["resubmits"] == 0
        else:  # the prompt was prefilled and sampled from in the first step, then one token a step until the push
            assert before == STEPS_BEFORE_PUSH and s["resubmits"] == 1
        # each token's behaviour logprob is the model of its version's, on the exact prefix before it
        old = _logprobs(embedded_model, s["prompt_ids"], s["token_ids"])
        new = _logprobs(other, s["prompt_ids"], s["token_ids"])
        for i, (lp, v) in enumerate(zip(s["logprobs"], s["versions"])):
            assert abs(lp - (old if v == 0 else new)[i]) < 1e-4, (uid, i, v, lp, old[i], new[i])
            if v == 1:
                moved = max(moved, abs(lp - old[i]))
    assert moved > 1e-2  # the two policies differ where it matters: a version mix-up would show


ACTOR_DRIVER = textwrap.dedent("""
    import json, sys, time
    import ray
    from safetensors.torch import load_file
    from workers.rollout import CPU_ENV, EngineSpec, RolloutWorker
    from workers.weight_buckets import param_specs, plan_buckets, to_object

    if __name__ == "__main__":
        base, other, root = sys.argv[1], sys.argv[2], sys.argv[3]
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": dict(CPU_ENV, PYTHONPATH=root)})
        actor = ray.remote(RolloutWorker).options(max_concurrency=1).remote(
            EngineSpec(model_path=other, dtype="float32", max_model_len=64, kv_cache_gib=0.1, seed=0))
        ray.get(actor.stream_start.remote(1.0, 1.0))
        prompts = [(f"q{i}", f"{i}+{2 * i}=", {"i": i}) for i in range(16)]
        submitted = ray.get(actor.stream_submit.remote(prompts, 4, 40, [0] * len(prompts)))
        taken = []
        while not taken:  # the first samples are done: the others are mid-generation
            taken += ray.get(actor.stream_take.remote()).samples
        weights = load_file(f"{base}/model.safetensors")
        specs = param_specs(weights.items())
        refs = [ray.put(to_object(p, [weights[n] for n in p.names])) for p in plan_buckets(specs, 1 << 20)]
        push = ray.get(actor.load_weights.remote(refs, 1))
        submitted += ray.get(actor.stream_submit.remote([("late", "3+4=", {})], 2, 40, [1]))
        # a call-by-call request (an eval) while streaming: the stream pauses for it and goes on
        during = ray.get(actor.generate.remote([("x", "1+1=", {})], 1, 4, 1.0, 1.0, 0))
        deadline = time.time() + 300
        while len(taken) < submitted and time.time() < deadline:
            taken += ray.get(actor.stream_take.remote()).samples
            time.sleep(0.05)
        dropped = ray.get(actor.stream_stop.remote())
        rows = [dict(uid=s.prompt_uid, j=s.sample_index, versions=s.token_versions, version=s.policy_version,
                     n=len(s.completion_ids), lp=len(s.logprobs), meta=s.metadata, finish=s.finish_reason)
                for s in taken]
        print("RESULT", json.dumps({"push": push, "rows": rows, "submitted": submitted, "dropped": dropped,
                                    "during": [(s.prompt_uid, s.policy_version, s.token_versions) for s in during]}))
""")


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_a_streaming_rollout_actor_takes_a_push_while_it_generates(tmp_path, embedded_model):
    """The `rollout-i` actor's stream (stream_start/submit/take/stop): generation goes on between the driver's
    calls, a weight push through the ordinary load_weights lands mid-generation (some samples span it, their
    token versions 0...0 1...1), nothing is lost or returned twice, the samples sent after the push are the new
    version's, and a call-by-call request (an eval) is answered with the stream paused for it."""
    other = _perturbed_copy(embedded_model, tmp_path / "other")  # its completions run long: pushes meet them
    r = subprocess.run([sys.executable, "-c", ACTOR_DRIVER, str(embedded_model), str(other), str(ROOT)], cwd=ROOT,
                       env=subprocess_env(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0"), capture_output=True,
                       text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-4000:]
    out = json.loads(lines[0][len("RESULT "):])
    rows = out["rows"]
    assert out["submitted"] == 16 * 4 + 2 and out["dropped"] == 0 and out["push"]["version"] == 1
    assert sorted((x["uid"], x["j"]) for x in rows) == sorted([(f"q{i}", j) for i in range(16) for j in range(4)]
                                                              + [("late", 0), ("late", 1)])
    spans = 0
    for x in rows:
        v = x["versions"]
        assert len(v) == x["n"] == x["lp"] and 0 < x["n"] <= 40 and v == sorted(v) and set(v) <= {0, 1}
        assert x["version"] == min(v)
        spans += len(set(v)) == 2
        if x["uid"] == "late":
            assert set(v) == {1}
        else:
            assert x["meta"] == {"i": int(x["uid"][1:])}
    assert spans > 0  # the push met samples mid-generation, and they went on
    assert out["during"] == [["x", 1, None]]  # answered by the pushed weights, outside the stream


class _FailingStream:
    """A stream whose engine step raises once a request is in flight (a dead engine mid-stream)."""

    def __init__(self):
        self.in_flight = {}

    def step(self):
        raise RuntimeError("engine step failed")

    def abort_all(self):
        return 0


def test_a_call_to_a_stream_whose_thread_ended_is_answered_at_once_not_after_its_timeout():
    """StreamService: a call queued after the stream's thread ended (closed, or its engine step raised between the
    caller's check and the queueing) fails at once naming why, instead of waiting out its timeout (the end of an
    async run waited 300 s on one engine's `stream_stop` this way)."""
    import time

    from workers.stream import StreamService

    closed = StreamService(_FailingStream(), lambda p: p)
    closed.close()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="was closed"):
        closed.call(lambda: 1, "stream_stop", timeout=60)
    assert time.monotonic() - t0 < 5
    failing = StreamService(_FailingStream(), lambda p: p)
    failing.stream.in_flight = {"p": None}  # the next step raises and ends the thread
    failing.thread.join(10)
    failing.error = None  # as if the caller had checked just before the thread ended
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="generation stream"):
        failing.call(lambda: 1, "stream_stop", timeout=60)
    assert time.monotonic() - t0 < 5


class _FinishesWhenCalled:
    """A stream whose one sample finishes in the step during which a call is queued (``stream_stop``'s abort)."""

    def __init__(self):
        self.in_flight, self.service = 1, None

    def step(self):
        import time
        from types import SimpleNamespace

        while self.service is None or self.service.commands.empty():  # the service starts stepping at once
            time.sleep(0.01)
        self.in_flight = 0
        return [SimpleNamespace(uid="u/0")]

    def abort_all(self):
        return self.in_flight


def test_a_sample_that_finishes_while_the_stream_stops_is_not_an_error():
    """RolloutWorker.stream_stop forgets the streamed samples only after the stream's last step: a sample that
    finishes while the stop's abort waits for the step to end finds its entry (the async fixture's run ended with
    ``KeyError('s6-8/6')`` on the stream's thread, which left the engine's requests unaborted for the next run)."""
    from types import SimpleNamespace

    from workers.rollout import RolloutWorker
    from workers.stream import StreamService

    stream = _FinishesWhenCalled()
    worker = SimpleNamespace(streamed={"u/0": ("u", 0, "text", {})})
    worker.service = stream.service = StreamService(stream, lambda p: worker.streamed.pop(p.uid))
    assert RolloutWorker.stream_stop(worker) == 0
    assert stream.service.error is None and worker.streamed == {} and worker.service is None
