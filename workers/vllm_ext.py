"""vLLM ``worker_extension_cls``: methods mixed into every vLLM worker, reached through ``collective_rpc``.

``fleetrl_reload_weights`` reloads the model in place from (name, tensor) pairs through the worker's own
``reload_weights`` (vLLM's in-place, layer-wise reload), so no engine restart and no disk round trip.
The name is prefixed because the CPU worker already has a method named ``update_weights``.
"""

from __future__ import annotations

from typing import Iterable

import torch


class WeightSyncExtension:
    def fleetrl_reload_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load checkpoint-format weights in place; returns the number of tensors loaded."""
        count = 0

        def counted():
            nonlocal count
            for name, tensor in weights:
                count += 1
                yield name, tensor

        self.reload_weights(weights_iterator=counted())
        return count
