"""The attention function every model of the engine runs through, registered with transformers.

The engine hands each forward an explicit 4-D bool mask (B, 1, N, L): the committed prefix is fully visible and the
last N columns carry the tree mask (ancestor-or-self; a lower triangle for a causal block). Backends:
  "sdpa"   -- transformers' own SDPA attention with that mask (the CPU default);
  "triton" -- eagle_fsd.kernels.tree_attention, which reads only the (N, N) tree block, bit-packed (the CUDA
              default; on CPU it runs under TRITON_INTERPRET=1, for tests).
With "auto", the kernel serves forwards on top of a cached prefix (tree verification, draft levels, catch-up) and
SDPA serves prompt prefill (no prefix: SDPA's causal kernels are faster there). The backend is chosen per model
through `config.eagle_fsd_attention` ("auto", "sdpa" or "triton").
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTENTION_NAME = "eagle_fsd"
BACKENDS = ("auto", "sdpa", "triton")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"attention={backend!r} is not one of {BACKENDS}")


def _use_kernel(backend: str, query: torch.Tensor, key: torch.Tensor) -> bool:
    if backend == "auto":
        return query.device.type == "cuda" and key.shape[2] > query.shape[2]
    return backend == "triton"


_packed = {"mask": None, "packed": None}  # one forward's packed tree block, shared by all its layers


def packed_tree_block(attention_mask: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """The bit-packed (B, N, W) tree block of a (B, 1, N, L) bool mask; no mask means causal."""
    from eagle_fsd.kernels import pack_tree_mask

    if attention_mask is None:
        return pack_tree_mask(torch.ones(n, n, dtype=torch.bool, device=device).tril())
    if _packed["mask"] is not attention_mask:
        block = attention_mask[:, 0, :, -n:]
        if block.dtype != torch.bool:
            block = block == 0  # additive float mask: 0 = visible
        _packed["mask"], _packed["packed"] = attention_mask, pack_tree_mask(block)
    return _packed["packed"]


def eagle_fsd_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    backend = getattr(module.config, "eagle_fsd_attention", "auto")
    if _use_kernel(backend, query, key):
        from eagle_fsd.kernels import tree_attention

        tree_mask = packed_tree_block(attention_mask, query.shape[2], query.device)
        return tree_attention(query, key, value, tree_mask, scale=scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(ATTENTION_NAME, eagle_fsd_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
