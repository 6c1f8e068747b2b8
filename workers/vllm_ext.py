"""vLLM ``worker_extension_cls``: methods mixed into every vLLM worker, reached through ``collective_rpc``.

``fleetrl_reload_weights`` reloads the model in place from (name, tensor) pairs through the worker's own
``reload_weights`` (vLLM's in-place, layer-wise reload), so no engine restart and no disk round trip.
The name is prefixed because the CPU worker already has a method named ``update_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class WeightSyncExtension:
    def fleetrl_reload_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load checkpoint-format weights in place; returns the number of tensors loaded."""
        count = 0
        dtype = self.model_runner.model_config.dtype  # the engine's (e.g. bf16 engines under an fp32 learner)

        def counted():
            nonlocal count
            for name, tensor in weights:
                count += 1
                # cast here, not in vLLM's loader, which warns once per tensor on every push when dtypes differ
                yield name, tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor

        self.reload_weights(weights_iterator=counted())
        self._fleetrl_retie_embeddings()
        return count

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
