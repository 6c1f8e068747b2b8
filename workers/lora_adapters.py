"""The policy served as base + LoRA adapter (``learner.lora.push: adapter``): each push is a new adapter version.

The engine starts with vLLM's LoRA support on (``enable_lora``, ``max_lora_rank``). A push delivers the adapter
tensors under PEFT's names; :class:`ServedAdapter` writes them as a PEFT adapter directory (``adapter_config.json``
with the rank, alpha and the target modules read off the tensor names; ``adapter_model.safetensors``), registers
it as a new ``LoRARequest`` (a new id per policy version, loaded right away so the push pays for it, not the next
request) and unloads the previous version. Every generate call passes :attr:`ServedAdapter.request`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch


def engine_kwargs(spec: dict) -> dict:
    """vLLM ``LLM(...)`` arguments for serving one adapter of ``spec["rank"]`` (:meth:`LoraSection.engine_spec`)."""
    return {"enable_lora": True, "max_lora_rank": spec["max_rank"], "max_loras": 1, "max_cpu_loras": 2}


class ServedAdapter:
    def __init__(self, llm, spec: dict, name: str):
        self.llm, self.spec = llm, spec
        self.root = Path(tempfile.mkdtemp(prefix=f"fleetrl-lora-{name}-"))
        self.request = None  # the LoRARequest of the version being served (None: the base, before any push)

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Serve the pushed adapter as ``version``; returns the number of tensors received."""
        from vllm.lora.request import LoRARequest

        state = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors}
        path = write_adapter(state, self.spec, self.root / f"v{version}")
        previous = self.request
        # ids start at 1 (vLLM), and a replaced engine may load the version the others serve: id = version + 1
        self.request = LoRARequest(f"policy-v{version}", version + 1, str(path))
        engine = self.llm.llm_engine
        engine.add_lora(self.request)
        if previous is not None and previous.lora_int_id != self.request.lora_int_id:
            engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return len(state)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def write_adapter(state: dict[str, torch.Tensor], spec: dict, path: Path) -> Path:
    """``state`` (PEFT's tensor names) as a PEFT adapter directory: ``adapter_model.safetensors`` and an
    ``adapter_config.json`` whose target modules are the adapted modules' last names."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "adapter_model.safetensors"))
    targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in state})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec["rank"], "lora_alpha": spec["alpha"],
              "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "modules_to_save": None, "use_rslora": False, "use_dora": False}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path

