"""The attention function every model of the engine runs through, registered with transformers.

The engine hands each forward an explicit 4-D bool mask (B, 1, N, L): the committed prefix is fully visible and the
last N columns carry the tree mask (ancestor-or-self; a lower triangle for prefill). Backends:
  "sdpa"   -- transformers' own SDPA attention with that mask (CPU default);
  "triton" -- eagle_fsd.kernels.tree_attention, which reads only the (N, N) tree block (CUDA default; on CPU it
              runs under TRITON_INTERPRET=1, for tests).
The backend is chosen per model through `config.eagle_fsd_attention` ("auto", "sdpa" or "triton").
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTENTION_NAME = "eagle_fsd"
BACKENDS = ("auto", "sdpa", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "sdpa"
    return backend


def tree_mask_block(attention_mask: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """The (B, N, N) tree block of a (B, 1, N, L) bool mask; no mask means causal (prefill or one decode token)."""
    if attention_mask is None:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0  # additive float mask: 0 = visible
    return attention_mask[:, 0, :, -n:]


def eagle_fsd_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    backend = resolve_backend(getattr(module.config, "eagle_fsd_attention", "auto"), query.device)
    if backend == "triton":
        from eagle_fsd.kernels import tree_attention

        tree_mask = tree_mask_block(attention_mask, query.shape[2], query.device)
        return tree_attention(query, key, value, tree_mask, scale=scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(ATTENTION_NAME, eagle_fsd_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
