"""vLLM ``worker_extension_cls``: methods mixed into every vLLM worker, reached through ``collective_rpc``.

``fleetrl_reload_weights`` reloads the model in place from (name, tensor) pairs through the worker's own
``reload_weights`` (vLLM's in-place, layer-wise reload), so no engine restart and no disk round trip.
The name is prefixed because the CPU worker already has a method named ``update_weights``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
INPLACE_LOGGER = "vllm.model_executor.model_loader.reload.inplace"


class ExpectedReloadWarnings(logging.Filter):
    """Drops exactly vLLM's "<layer>: Failed to load weights" warnings that every in-place push causes and that do
    not matter, and nothing else. The layer-wise reload warns for a layer none of whose tensors were pushed and then
    puts the layer's existing tensors back. For two layers that is right: ``RotaryEmbedding`` holds only its cos/sin
    cache, computed from the config and never a checkpoint tensor; ``ParallelLMHead`` with tied embeddings has no
    ``lm_head.weight`` in the checkpoint format and is re-tied to the freshly loaded embedding right after the load
    (:meth:`WeightSyncExtension._fleetrl_retie_embeddings`). Any other layer's warning would mean a tensor really
    went missing, so it is kept."""

    def __init__(self, layers: set[str], partial: bool = False):
        super().__init__()
        self.layers, self.partial = layers, partial

    def filter(self, record: logging.LogRecord) -> bool:
        if self.partial and record.msg == "Following weights were not loaded from checkpoint: %s":
            return False
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and (self.partial or record.args[0] in self.layers))


class WeightSyncExtension:
    def fleetrl_reload_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load checkpoint-format weights in place; returns the number of tensors loaded."""
        count = 0
        dtype = self.model_runner.model_config.dtype  # the engine's (e.g. bf16 engines under an fp32 learner)
        self._fleetrl_push_sums = {}

        def counted():
            nonlocal count
            for name, tensor in weights:
                count += 1
                if tensor.is_floating_point():  # as received, before the cast: compared with the learner's
                    self._fleetrl_push_sums[name] = (float(tensor.sum(dtype=torch.float64)),
                                                      float(tensor.abs().sum(dtype=torch.float64)))
                # cast here, not in vLLM's loader, which warns once per tensor on every push when dtypes differ
                yield name, tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor

        self._fleetrl_filter_reload_warnings()
        self.reload_weights(weights_iterator=counted())
        self._fleetrl_retie_embeddings()
        return count

    def fleetrl_push_checksums(self) -> dict[str, tuple[float, float]]:
        """``name -> (sum, sum of |x|)`` in float64 of every floating tensor the last push delivered, as received
        (the mismatch doctor compares them with the learner's); empty before the first push."""
        return dict(getattr(self, "_fleetrl_push_sums", {}))

    def fleetrl_expect_partial_push(self) -> None:
        """Pushes will carry only some layers (a LoRA run's merged push sends the blocks with adapters): every
        other layer keeps its tensors, as vLLM's reload does for a layer none of whose tensors arrived, so its
        warnings about those layers say nothing wrong. The push probe still checks every push."""
        self._fleetrl_partial = True

    def fleetrl_named_weights(self) -> dict[str, torch.Tensor]:
        """The weights the engine computes with, under vLLM's names (fused ``qkv_proj`` / ``gate_up_proj``; a tied
        ``lm_head.weight`` listed too), as CPU copies: what tests compare with the learner's weights after a push.
        A linear layer's weight is read through the layer itself (its ``quant_method`` applied to an identity
        matrix), because backends may repack it for their GEMM: vLLM's CPU backend keeps only the prepacked copy
        and leaves ``.weight`` empty. Multiplying by the identity is exact in every float format."""
        model = self.model_runner.get_model()
        out = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters(remove_duplicate=False)}
        with torch.no_grad():
            for name, module in model.named_modules():
                method, weight = getattr(module, "quant_method", None), getattr(module, "weight", None)
                width = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
                if method is None or weight is None or not width or not hasattr(method, "apply"):
                    continue
                eye = torch.eye(width, dtype=weight.dtype if weight.numel() else module.params_dtype,
                                device=weight.device)
                out[f"{name}.weight"] = method.apply(module, eye).T.to("cpu", copy=True)
        return out

    def _fleetrl_filter_reload_warnings(self) -> None:
        if getattr(self, "_fleetrl_reload_filter", None) is None:
            tied = getattr(getattr(self.model_runner.get_model(), "config", None), "tie_word_embeddings", False)
            self._fleetrl_reload_filter = ExpectedReloadWarnings(
                {"RotaryEmbedding"} | ({"ParallelLMHead"} if tied else set()), getattr(self, "_fleetrl_partial", False))
            for name in (RELOAD_LOGGER, INPLACE_LOGGER):
                logging.getLogger(name).addFilter(self._fleetrl_reload_filter)

    def _fleetrl_retie_embeddings(self) -> None:
        """With tied input/output embeddings the checkpoint has no ``lm_head.weight``, and the layer-wise reload
        puts the *old* head tensors back (logging "ParallelLMHead: Failed to load weights"), including the CPU
        backend's prepacked GEMM weight. Copy the freshly loaded embedding into the head and redo the head's
        post-load processing (the CPU prepack) so the output layer matches the learner."""
        model = self.model_runner.get_model()
        hf_config = getattr(model, "config", None)
        head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if getattr(hf_config, "tie_word_embeddings", False) and head is not None and embed is not None:
            if head.weight.data_ptr() != embed.weight.data_ptr():
                head.weight.data.copy_(embed.weight.data)
            method = getattr(head, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(head)
