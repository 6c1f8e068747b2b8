"""The ``remote`` reward: score a completion with an HTTP service (a judge, a verifier farm, a sandbox).

Request: ``POST params["url"]`` with JSON ``{"prompt": str, "completion": str, "metadata": dict}``.
Response: JSON ``{"reward": float}`` (one value, named ``remote``) or ``{"rewards": {name: float}}`` (named
components, ``remote/<name>``, e.g. for GDPO).

Each attempt may take ``timeout_s``; connection errors, timeouts and 5xx answers are retried up to ``retries``
times with exponential backoff (``backoff_s``, then twice that, ...); a 4xx answer is the request's fault and is
not retried. A bad or failed response raises :class:`RemoteRewardError`, which the reward worker turns into a 0
score counted in ``reward/errors``. Keep ``(retries + 1) * timeout_s`` plus the backoff within
``reward.timeout_s``, or the worker gives up on the call first.

One module-level ``httpx.Client`` (thread-safe, pooled keep-alive connections) serves every call of the
worker's thread pool.
"""

from __future__ import annotations

import math
import time

import httpx

from rewards.functions import register_reward

_CLIENT = httpx.Client(limits=httpx.Limits(max_connections=64, max_keepalive_connections=32))


class RemoteRewardError(RuntimeError):
    """The remote reward service failed or answered something that is not a reward."""


@register_reward("remote")
def remote_reward(prompt: str, completion: str, metadata: dict, url: str = "", timeout_s: float = 10.0,
                  retries: int = 2, backoff_s: float = 0.5) -> float | dict[str, float]:
    """The reward the service at ``url`` gives this completion (see the module docstring for the protocol)."""
    if not url:
        raise RemoteRewardError("reward function 'remote' needs params.url (e.g. {url: http://host:8000/score})")
    payload = {"prompt": prompt, "completion": completion, "metadata": metadata}
    return parse_response(url, _post(url, payload, timeout_s, retries, backoff_s))


remote_reward.bounds_itself = True  # I/O: per-attempt HTTP timeouts, run on the reward actor's threads


def _post(url: str, payload: dict, timeout_s: float, retries: int, backoff_s: float) -> httpx.Response:
    """POST with retries on transport errors and 5xx; returns the first 2xx response."""
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            resp = _CLIENT.post(url, json=payload, timeout=timeout_s)
        except httpx.TimeoutException:
            last = f"timed out after {timeout_s}s"
            continue
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e}"
            continue
        if resp.status_code >= 500:
            last = f"HTTP {resp.status_code}: {resp.text[:200]!r}"
            continue
        if resp.status_code >= 400:
            raise RemoteRewardError(f"remote reward {url}: HTTP {resp.status_code} (not retried): {resp.text[:200]!r}")
        return resp
    raise RemoteRewardError(f"remote reward {url}: giving up after {retries + 1} attempt(s); last: {last}")


def parse_response(url: str, resp: httpx.Response) -> float | dict[str, float]:
    """``{"reward": x}`` -> x; ``{"rewards": {name: x}}`` -> the dict; anything else raises."""
    try:
        body = resp.json()
    except ValueError:
        raise RemoteRewardError(f"remote reward {url}: response is not JSON: {resp.text[:200]!r}") from None
    if isinstance(body, dict) and "reward" in body:
        return _number(url, "reward", body["reward"])
    if isinstance(body, dict) and isinstance(body.get("rewards"), dict) and body["rewards"]:
        return {str(k): _number(url, f"rewards.{k}", v) for k, v in body["rewards"].items()}
    raise RemoteRewardError(f"remote reward {url}: expected {{\"reward\": float}} or {{\"rewards\": {{name: float}}}}, "
                            f"got {str(body)[:200]}")


def _number(url: str, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RemoteRewardError(f"remote reward {url}: {key} must be a finite number, got {value!r}")
    return float(value)
