"""Build the benchmark models: Qwen2-architecture causal LMs with the embedded character tokenizer, random init.

    python -m bench.build_models                 # every preset that is missing or built from another recipe
    python -m bench.build_models gen-heavy       # just one

Each preset is written to ``.fleetrl/models/bench-<name>`` as an ordinary HF directory (config, safetensors,
tokenizer) that transformers, vLLM, fleetrl and TRL all load. The build is deterministic (seeded init) and a
``fleetrl_bench.json`` beside the weights records the recipe, so a changed recipe is rebuilt.

**No early EOS.** Throughput benchmarks need completions of the full requested length in every system (vLLM,
HF ``generate``, TRL) without per-system switches (``ignore_eos``, ``min_new_tokens``). So these models never
sample a special token (``<pad>``, ``<eos>``, ``<bos>``): residual dimension 0 carries a constant (every token
embedding has ``x_0 = 1`` and no attention or MLP output projection writes there), so after the final RMSNorm,
whose weight on dimension 0 is 50, ``h_0`` is large and positive at every position (~80 for gen-heavy). Only the
special tokens' (untied) output rows read dimension 0, with weight -1, so their logits sit near -80 while the
others stay within a few units of 0. :func:`check_no_special_tokens` verifies it on real prompts at build time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from orchestrator.models.embedded_model import SPECIALS, build_tokenizer

MODELS_DIR = Path(".fleetrl/models")

# hidden, intermediate, layers, attention heads, kv heads, head dim, max positions (prompt + 128 tokens fits)
PRESETS: dict[str, dict] = {
    # the generation-heavy config's model (configs/gen_heavy.yaml): ~24 M params
    "gen-heavy": dict(hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=2, head_dim=64, max_pos=256),
    # --quick stand-in for gen-heavy: same recipe, ~0.4 M params
    "gen-tiny": dict(hidden=128, intermediate=384, layers=2, heads=4, kv_heads=2, head_dim=32, max_pos=256),
    # weight-push sizes
    "push-1m": dict(hidden=128, intermediate=384, layers=5, heads=4, kv_heads=2, head_dim=32, max_pos=256),
    "push-10m": dict(hidden=384, intermediate=1152, layers=6, heads=6, kv_heads=2, head_dim=64, max_pos=256),
    "push-100m": dict(hidden=1024, intermediate=3328, layers=8, heads=16, kv_heads=2, head_dim=64, max_pos=256),
    # Qwen2.5-0.5B's layer shapes (hidden 896, 24 layers, 14 heads, 2 kv heads) with the character vocabulary:
    # ~0.36 B params (bench.push_dtype)
    "push-500m": dict(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, head_dim=64, max_pos=256),
}
SEED = 1234


def model_path(name: str) -> Path:
    return MODELS_DIR / f"bench-{name}"


def build_model(name: str):
    """The preset ``name`` as a random-init ``Qwen2ForCausalLM`` that never samples a special token."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    p = PRESETS[name]
    torch.manual_seed(SEED)
    cfg = Qwen2Config(
        vocab_size=len(build_tokenizer()), hidden_size=p["hidden"], intermediate_size=p["intermediate"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
        head_dim=p["head_dim"], max_position_embeddings=p["max_pos"], tie_word_embeddings=False,
        rope_theta=10000.0, bos_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(cfg)
    _suppress_special_tokens(model, special_ids=list(range(len(SPECIALS))))
    return model.eval()


@torch.no_grad()
def _suppress_special_tokens(model, special_ids: list[int], gain: float = 50.0) -> None:
    """A constant residual dimension 0, amplified by the final norm and read only by the special tokens' output
    rows, with a negative sign (module doc)."""
    inner = model.model
    inner.embed_tokens.weight[:, 0] = 1.0
    for layer in inner.layers:
        layer.self_attn.o_proj.weight[0, :] = 0.0
        layer.mlp.down_proj.weight[0, :] = 0.0
    inner.norm.weight[0] = gain
    head = model.lm_head.weight
    head[:, 0] = 0.0
    head[special_ids] = 0.0
    head[special_ids, 0] = -1.0


@torch.no_grad()
def check_no_special_tokens(model, tokenizer, steps: int = 16) -> float:
    """Sample ``steps`` tokens for a few prompts and return the largest probability any special token got at any
    position; raises if it is not negligible."""
    from rewards.tasks import ArithmeticTask

    prompts = [p.text for p in ArithmeticTask().train_batch(0, 8)]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    ids, attn = enc["input_ids"], enc["attention_mask"]
    worst = 0.0
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        probs = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1].softmax(-1)
        worst = max(worst, probs[:, : len(SPECIALS)].max().item())
        nxt = torch.multinomial(probs, 1, generator=gen)
        ids, attn = torch.cat([ids, nxt], 1), torch.cat([attn, torch.ones_like(nxt)], 1)
    if worst > 1e-9:
        raise RuntimeError(f"special-token probability {worst:.2e} is not negligible: completions could end early")
    return worst


def build(name: str, force: bool = False, log=print) -> Path:
    """Write preset ``name`` unless the same recipe is already there; returns its directory."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; valid: {sorted(PRESETS)}")
    out = model_path(name)
    recipe = {"preset": name, "seed": SEED, **PRESETS[name], "no_special_tokens": True}
    stamp = out / "fleetrl_bench.json"
    if not force and stamp.exists() and json.loads(stamp.read_text()).get("recipe") == recipe:
        return out
    torch.set_num_threads(2)
    tokenizer = build_tokenizer()
    model = build_model(name)
    worst = check_no_special_tokens(model, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    stamp.write_text(json.dumps({"recipe": recipe, "params": n_params, "max_special_prob": worst}, indent=1))
    log(f"build_models: {out}: {n_params / 1e6:.2f} M params, max special-token prob {worst:.1e}")
    return out


def params_of(name: str) -> int:
    """Parameter count of a built preset (from its stamp)."""
    return json.loads((model_path(name) / "fleetrl_bench.json").read_text())["params"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"presets to build (default: all): {', '.join(PRESETS)}")
    ap.add_argument("--force", action="store_true", help="rebuild even if the same recipe exists")
    args = ap.parse_args(argv)
    for name in args.names or PRESETS:
        path = build(name, force=args.force)
        print(f"{name:10} {params_of(name) / 1e6:7.2f} M params  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
