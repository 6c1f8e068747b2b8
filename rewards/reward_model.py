"""Reward model: an HF sequence-classification model with one output (``num_labels=1``) that scores
(prompt, completion) pairs; the score is the logit at the last token of ``prompt + completion``.

:class:`RewardModelWorker` is a plain class; ``orchestrator.rl.pools.RewardModelPool`` wraps it with ``ray.remote``
and names the actors ``reward-model-i``. With ``reward.model.path`` set, every scored sample gets a component
``reward_model`` (weight ``reward.model.weight`` in the summed reward).

:func:`build_tiny_reward_model` builds the embedded one for the arithmetic task: the embedded policy's backbone
with a fresh scalar head, trained for a few seconds (binary cross-entropy) to tell the policy's own correct
samples from its wrong ones. Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path

from common.actor_logs import LoggedActor
from common.imports import skip_unused_imports

EMBEDDED_REWARD_MODEL_PATH = ".fleetrl/models/arith-rm"


def encode_pairs(tokenizer, pairs: list[tuple[str, str]]):
    """Right-padded ``(input_ids [b, L], attention_mask [b, L])`` of ``prompt + completion`` per pair.

    Right padding keeps every sequence's positions 0..len-1 (as when it is scored alone) and puts its last
    token at ``len - 1``, which is where HF's sequence-classification head pools (the rightmost non-pad token).
    """
    import torch

    rows = [tokenizer(p + c)["input_ids"] or [tokenizer.pad_token_id] for p, c in pairs]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    return ids, attn


def load_reward_model(path: str | Path, dtype: str = "float32"):
    """``(tokenizer, model)`` of an HF sequence-classification reward model with a single output, in eval mode.
    A tokenizer without a pad token pads with EOS (and the model config learns that id)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
    if model.config.num_labels != 1:
        raise ValueError(f"reward.model.path: {path} has num_labels={model.config.num_labels}; a reward model "
                         "needs exactly one output (num_labels=1)")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, model.eval().requires_grad_(False)


class RewardModelWorker(LoggedActor):
    """Scores (prompt, completion) pairs with a sequence-classification reward model, ``batch_size`` pairs per
    forward pass. Plain class (testable without Ray)."""

    def __init__(self, model_path: str, batch_size: int, dtype: str = "float32", torch_threads: int = 1):
        self._start_logging()
        skip_unused_imports()
        import torch

        torch.set_num_threads(torch_threads)
        self.tokenizer, self.model = load_reward_model(model_path, dtype)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.model.to(self.device)
        self.batch_size = batch_size
        self.scored = 0

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """The reward model's logit for each (prompt, completion), in order."""
        import torch

        out: list[float] = []
        with torch.no_grad():
            for i in range(0, len(pairs), self.batch_size):
                ids, attn = encode_pairs(self.tokenizer, pairs[i: i + self.batch_size])
                logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits
                out.extend(logits[:, 0].float().cpu().tolist())
        self.scored += len(pairs)
        return out


def _sample_completions(policy, tokenizer, prompts: list[str], max_new_tokens: int, generator) -> list[str]:
    """Temperature-1 samples from a causal LM by repeated full forwards (tiny models only)."""
    import torch

    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    ids, attn = enc["input_ids"], enc["attention_mask"]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out = [[] for _ in prompts]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            logits = policy(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1]
            nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)[:, 0]
            for i, t in enumerate(nxt.tolist()):
                done[i] |= t == tokenizer.eos_token_id
                if not done[i]:
                    out[i].append(t)
            ids, attn = torch.cat([ids, nxt[:, None]], 1), torch.cat([attn, torch.ones_like(nxt)[:, None]], 1)
    return [tokenizer.decode(o, skip_special_tokens=True) for o in out]


def _policy_groups(policy_path: str, prompts, k: int, seed: int, max_new_tokens: int):
    """``k`` temperature-1 samples of the policy per prompt, each ``(prompt, completion, correct)`` by the
    ``math`` checker; one list per prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rewards.functions import math_reward, verdicts

    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    policy = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    gen = torch.Generator().manual_seed(seed)
    texts = _sample_completions(policy, tokenizer, [p.text for p in prompts for _ in range(k)], max_new_tokens, gen)
    ok = verdicts(math_reward, [(p.text, texts[i * k + j], p.metadata)
                                for i, p in enumerate(prompts) for j in range(k)])
    return [[(p.text, texts[i * k + j], ok[i * k + j]) for j in range(k)] for i, p in enumerate(prompts)]


@contextlib.contextmanager
def _one_torch_thread():
    """Tiny matrices: more torch threads only spin (measured ~10x the CPU time on 2 busy cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@_one_torch_thread()
def build_tiny_reward_model(out_dir: str | Path, policy_path: str | Path, steps: int = 100, pairs_per_step: int = 32,
                            lr: float = 1e-3, num_prompts: int = 512, samples_per_prompt: int = 4, seed: int = 0,
                            max_new_tokens: int = 8, log=print) -> dict:
    """Build a tiny reward model for the arithmetic task and save it as an HF directory.

    The policy at ``policy_path`` (a Qwen2 causal LM, e.g. the embedded model) gives the backbone; the scalar
    head (``score``) is new. Training pairs: for ``num_prompts`` training-split prompts, the reference answer
    against each of the policy's wrong temperature-1 samples (``samples_per_prompt`` per prompt); loss:
    Bradley-Terry ``-log sigmoid(s_correct - s_wrong)``, ``steps`` AdamW steps of ``pairs_per_step`` pairs
    (~25 s on 2 busy CPU cores for the embedded model; ``steps=0`` keeps the fresh head). Returns a summary
    with the held-out ranking accuracy (200 eval-split prompts, 8 policy samples each: how often a correct
    sample outscores a wrong one of the same prompt; 0.5 is chance), also written to
    ``fleetrl_reward_model.json``.

    Measured on the embedded model (seed 0): held-out ranking accuracy 0.56, barely above chance, and as a
    best-of-16 selector on the 400 eval prompts it picks a correct sample less often than a random pick would
    (`fleetrl eval --select reward_model`). The eval split (operands with equal last digits) never occurs in
    training, and a model that checks sums needs far more than seconds of training: this one exercises the
    reward-model path end to end, it is not a useful verifier."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rewards.tasks import ArithmeticTask

    t0 = time.time()
    torch.manual_seed(seed)
    task = ArithmeticTask()
    prompts = task.train_batch(10**6 + seed, num_prompts)
    groups = _policy_groups(str(policy_path), prompts, samples_per_prompt, seed, max_new_tokens)
    pairs = [(p.text, p.metadata["answer"], c) for p, grp in zip(prompts, groups) for _, c, ok in grp if not ok]
    held_out = _policy_groups(str(policy_path), task.eval_set(200), 8, seed + 1, max_new_tokens)
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    model = AutoModelForSequenceClassification.from_pretrained(policy_path, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    for step in range(steps if pairs else 0):
        batch = rng.sample(pairs, min(pairs_per_step, len(pairs)))
        ids, attn = encode_pairs(tokenizer, [(p, good) for p, good, _ in batch] + [(p, bad) for p, _, bad in batch])
        s = model(input_ids=ids, attention_mask=attn).logits[:, 0]
        loss = -torch.nn.functional.logsigmoid(s[: len(batch)] - s[len(batch):]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0:
            log(f"reward model: step {step + 1} pairwise loss {loss.item():.3f}")
    model.eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    summary = {"steps": steps, "train_pairs": len(pairs),
               "held_out_ranking_accuracy": ranking_accuracy(model, tokenizer, held_out),
               "seconds": round(time.time() - t0, 1), "policy": str(policy_path), "seed": seed}
    (out_dir / "fleetrl_reward_model.json").write_text(json.dumps(summary, indent=1))
    return summary


def ranking_accuracy(model, tokenizer, groups: list[list[tuple[str, str, bool]]]) -> float | None:
    """Over all (correct, wrong) pairs of samples of the same prompt: the fraction the model ranks correctly
    (ties count half), rounded to 4 places; None when no prompt has both."""
    import torch

    wins, total = 0.0, 0
    with torch.no_grad():
        for grp in groups:
            ids, attn = encode_pairs(tokenizer, [(p, c) for p, c, _ in grp])
            scores = model(input_ids=ids, attention_mask=attn).logits[:, 0].tolist()
            good = [s for s, (*_, ok) in zip(scores, grp) if ok]
            bad = [s for s, (*_, ok) in zip(scores, grp) if not ok]
            wins += sum((g > b) + 0.5 * (g == b) for g in good for b in bad)
            total += len(good) * len(bad)
    return round(wins / total, 4) if total else None


def ensure_reward_model(path: str | None, policy_path: str) -> None:
    """Build the embedded reward model when it is the configured one and missing (as the embedded policy is)."""
    if path is None or (Path(path) / "config.json").exists():
        return
    if path == EMBEDDED_REWARD_MODEL_PATH:
        from common.build_once import build_once

        def build() -> None:
            print(f"embedded reward model missing: building it in {path} from {policy_path}", flush=True)
            print(build_tiny_reward_model(path, policy_path), flush=True)

        build_once(path, build)
        return
    raise FileNotFoundError(f"reward.model.path: {path!r} is not a model directory (no config.json there); give "
                            f"a local HF sequence-classification model, or {EMBEDDED_REWARD_MODEL_PATH!r}")
