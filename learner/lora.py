"""LoRA on the policy through PEFT: adapters added in place, the base frozen, merged weights under the base's names.

With ``learner.lora.rank`` > 0 the learner's HF model gets PEFT LoRA layers in place (``get_peft_model``: the
HF module tree keeps its names, each adapted linear becomes a ``LoraLayer`` whose ``base_layer`` is the frozen
original). Only ``lora_A`` / ``lora_B`` are trainable, so only they reach DeepSpeed's optimizer. The KL reference
is the same model with the adapters switched off (``PeftModel.disable_adapter()``), no second copy.

What leaves the learner is always in the base model's format, so engines, exports and checkpoints' ``policy/``
need no LoRA support: :func:`merged_weights` maps each base tensor name to its current value, ``W + s * B A``
(PEFT's ``get_delta_weight``, ``s = alpha / r``) for an adapted layer's weight, the frozen tensor otherwise.
The push sends only the blocks with adapters (the rest never changes); an export writes every tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from workers.weight_buckets import TensorSpec

ADAPTER = "default"  # PEFT's name of the one adapter
VALUE_HEADS = ["score", "classifier"]  # a token-classification head's names (PEFT's own list for TOKEN_CLS)
Gather = Callable[[list[torch.Tensor]], contextlib.AbstractContextManager] | None


def add_adapters(hf_model, spec: dict, value_head: bool = False):
    """Wrap ``hf_model`` (modified in place) in a PEFT LoRA model from ``spec`` (:meth:`LoraSection.spec`);
    returns the ``PeftModel``. Only adapter parameters keep ``requires_grad``; with ``value_head`` (a critic: a
    token-classification model) also its fresh head (``score``, or ``classifier`` in some architectures), which
    PEFT keeps as a trainable copy (``modules_to_save``) and which gets no adapter of its own."""
    from peft import LoraConfig, get_peft_model

    head: dict[str, Any] = {"task_type": "TOKEN_CLS", "exclude_modules": VALUE_HEADS} if value_head else {}
    config = LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"],
                        target_modules=spec["target_modules"], bias="none", **head)
    try:
        return get_peft_model(hf_model, config)
    except ValueError as e:  # PEFT: "Target modules {...} not found in the base model"
        raise ValueError(f"learner.lora.target_modules={spec['target_modules']!r}: {e}") from None


def adapter_parameters(hf_model) -> dict[str, torch.Tensor]:
    """The trainable adapter tensors by name (``...lora_A.default.weight``, ``...lora_B.default.weight``)."""
    return {n: p for n, p in hf_model.named_parameters() if "lora_" in n}


def adapter_weights(hf_model) -> dict[str, torch.Tensor]:
    """The adapter tensors under the names PEFT saves them with (``base_model.model.<module>.lora_A.weight``): what
    the ``adapter`` push sends and the engines load as a LoRA adapter."""
    return {"base_model.model." + n.replace(f".{ADAPTER}.", "."): p for n, p in adapter_parameters(hf_model).items()}


def _lora_layers(hf_model) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in hf_model.named_modules() if isinstance(m, LoraLayer)}


def merged_weights(hf_model, adapted_only: bool, gather: Gather = None) -> MergedWeights:
    """The model's weights under the base model's names, adapters merged (see the module docstring):
    ``adapted_only`` keeps only the adapted layers' weights (what a push sends). ``gather`` is the ZeRO-3
    context that materializes shards (None when parameters are whole)."""
    return MergedWeights(hf_model, adapted_only, gather)


class MergedWeights(Mapping):
    """A lazy mapping base name -> tensor: each merged weight is computed when read, so a push holds one bucket
    of merged tensors at a time. :meth:`specs` gives (name, full shape, dtype) in push order."""

    def __init__(self, hf_model, adapted_only: bool, gather: Gather):
        self.layers = _lora_layers(hf_model)
        self.gather = gather
        self.sources: dict[str, tuple[torch.Tensor, Any]] = {}  # base name -> (weight, its LoraLayer or None)
        # engines fuse sibling linears (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and reload a fused layer only
        # when all of its parts arrive: a push sends every tensor of a block (self_attn, mlp) that has an adapter
        adapted_blocks = {name.rsplit(".", 1)[0] for name in self.layers}
        for name, p in hf_model.named_parameters():
            if "lora_" in name:
                continue
            base_name = name.replace(".base_layer.", ".")
            module = base_name.rsplit(".", 1)[0]
            if adapted_only and module.rsplit(".", 1)[0] not in adapted_blocks:
                continue
            self.sources[base_name] = (p, self.layers.get(module) if name.endswith(".base_layer.weight") else None)

    def specs(self) -> list[TensorSpec]:
        from workers.weight_buckets import param_specs

        return param_specs([(n, p) for n, (p, _) in self.sources.items()])

    def __getitem__(self, name: str) -> torch.Tensor:
        p, layer = self.sources[name]
        tensors = [p] + ([] if layer is None else [t for t in layer.parameters() if t is not p])
        with self.gather(tensors) if self.gather else contextlib.nullcontext(), torch.no_grad():
            if layer is None:
                return p.detach().clone() if self.gather else p.detach()
            return p.detach() + layer.get_delta_weight(ADAPTER).to(p.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def checkpoint_adapters_only(module: torch.nn.Module) -> None:
    """Make ``module.state_dict()`` (what a DeepSpeed checkpoint saves as the module) hold the trained tensors
    only, the adapters (and a critic's value head, ``score.modules_to_save``): the frozen base is the model path's,
    and a tied output embedding would otherwise be saved again (DeepSpeed's ``exclude_frozen_parameters`` skips
    frozen parameters by name, not their tied aliases)."""

    def drop_base(_module, state, _prefix, _metadata) -> None:
        for key in [k for k in state if "lora_" not in k and ".modules_to_save." not in k]:
            del state[key]

    module.register_state_dict_post_hook(drop_base)
