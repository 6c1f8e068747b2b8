"""Forward passes of the learner's models over a :class:`TrainBatch` micro-batch, as plain functions of the module
(so tests run them without DeepSpeed): the policy's response-token logprobs and entropy, the critic's values.

Every result is in the batch's ``[b, T]`` per-token layout, zero where ``response_mask`` is 0. Imports only torch
(and DeepSpeed for a ZeRO-3 partitioned LM head).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from learner.batch import TrainBatch, response_logprobs
from learner.logprobs import token_logprobs
from learner.packing import Layout, ModelInput, packed_input, padded_input


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Mixed precision: the forward (and so the backward) computes in ``dtype`` while parameters, gradients and
    optimizer state keep theirs; ``None`` computes in the parameters' dtype."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def model_input(mb: TrainBatch, layout: Layout) -> ModelInput:
    return packed_input(mb) if layout.packing else padded_input(mb)


class HiddenStatesLM(torch.nn.Module):
    """A causal LM whose forward returns the final (normed) hidden states ``[b, L, H]`` instead of logits. This is
    the module the DeepSpeed engine wraps, so the engine's forward (its backward hooks, ZeRO-3's parameter
    gathers) stays in the path while the LM head runs on the scored positions only, in chunks."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm  # the HF model: weight names, save_pretrained and the push read it

    def forward(self, **kwargs) -> Tensor:
        return self.lm.get_decoder()(**kwargs).last_hidden_state

    @property
    def head(self):
        return self.lm.get_output_embeddings()


def head_function(head: torch.nn.Module):
    """The LM head as a function of hidden states, for heads called outside the engine's forward.

    Under ZeRO-3 the head's weight (on tied models the input embedding) is a partition that DeepSpeed's module
    hooks gather for each call of the head and release after it, also when a chunk's activation checkpoint
    recomputes the head inside backward: the release then comes before backward reads the recomputed matmul's
    saved weight, which for a frozen weight (a LoRA base) is the parameter itself, by then an empty tensor. For a
    frozen head the weights are gathered once here and the head reads aliases of the full tensors, which keep them
    alive for the chunks' backward after the parameters are partitioned again. A trainable head is the head itself:
    autograd saves a detached alias of its gathered weight, and its gradient must land on a gathered parameter
    (an untied head's would meet an empty one after an alias). Without ZeRO-3 this is the head itself too."""
    params = list(head.parameters())
    if not any(hasattr(p, "ds_id") for p in params) or any(p.requires_grad for p in params):
        return head
    import deepspeed

    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"ZeRO-3: the chunked LM head must be a torch.nn.Linear, got {type(head).__name__}")
    with deepspeed.zero.GatheredParameters(params):
        weight = head.weight.view_as(head.weight)
        bias = None if head.bias is None else head.bias.view_as(head.bias)
    return lambda hidden: torch.nn.functional.linear(hidden, weight, bias)


def policy_logprobs(model, mb: TrainBatch, layout: Layout, temperature: float = 1.0, with_entropy: bool = True,
                    device: torch.device | None = None, dtype: torch.dtype | None = None
                    ) -> tuple[Tensor, Tensor | None]:
    """``(logp [b, T], entropy [b, T] or None)`` of the micro-batch's response tokens. ``model`` is a
    :class:`HiddenStatesLM` or the DeepSpeed engine wrapping one. The decoder runs over the packed (or padded)
    tokens; the LM head runs on the scored response positions only, ``layout.chunk_tokens`` at a time
    (:mod:`learner.logprobs`). ``layout.chunk_tokens == 0`` is the naive reference path: padded layout, logits over
    every position of the micro-batch and a full log-softmax (entropy always)."""
    device = device or torch.device("cpu")
    head = head_function(getattr(model, "module", model).head)
    mask = mb.response_mask.to(device)
    if not layout.chunk_tokens:
        x = padded_input(mb)
        with autocast(device, dtype):
            logits = head(model(**x.kwargs(device)))
        return response_logprobs(logits, mb.to(device), temperature)
    x = model_input(mb, layout)
    with autocast(device, dtype):
        hidden = model(**x.kwargs(device))
        hidden = hidden.reshape(-1, hidden.shape[-1])[x.scored.hidden_index.to(device)]
        logp, ent = token_logprobs(head, hidden, x.scored.targets.to(device), temperature, layout.chunk_tokens,
                                   with_entropy)
    shape = tuple(mb.response_mask.shape)
    return x.scored.scatter(logp, shape) * mask, x.scored.scatter(ent, shape) * mask if ent is not None else None


def critic_values(module, mb: TrainBatch, layout: Layout, device: torch.device | None = None,
                  dtype: torch.dtype | None = None) -> Tensor:
    """Values ``[b, T]`` of a token-classification critic (one output; ``module`` the model or the DeepSpeed engine
    wrapping it): V at the state before each response token (the position whose logits would predict it), read
    off the packed (or padded) forward."""
    device = device or torch.device("cpu")
    x = model_input(mb, layout)
    with autocast(device, dtype):
        out = module(**x.kwargs(device)).logits[..., 0].float()
    values = out.reshape(-1)[x.scored.hidden_index.to(device)]
    return x.scored.scatter(values, tuple(mb.response_mask.shape)) * mb.response_mask.to(device)
