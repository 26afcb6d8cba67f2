"""Thin glue to transformers: one forward of a decoder over new tokens on top of a cache, with an explicit mask."""
from __future__ import annotations

import inspect
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def _cache_kwarg(forward_fn) -> str:
    # transformers renamed `past_key_values` to `cache` during 5.x; support both spellings.
    return "cache" if "cache" in inspect.signature(forward_fn).parameters else "past_key_values"


def cache_kwargs(module: torch.nn.Module, cache) -> dict:
    return {_cache_kwarg(type(module).forward): cache, "use_cache": True}


def prefix_tree_mask(prefix_len: int, tree_mask: torch.Tensor) -> torch.Tensor:
    """(1, 1, N, prefix_len + N) bool: the committed prefix is fully visible, the new block follows tree_mask."""
    n = tree_mask.shape[0]
    visible = torch.ones(n, prefix_len, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([visible, tree_mask], dim=1)[None, None]


def causal_mask(prefix_len: int, n: int, device) -> torch.Tensor:
    return prefix_tree_mask(prefix_len, torch.ones(n, n, dtype=torch.bool, device=device).tril())


def decoder_forward(model, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor, positions: torch.Tensor):
    """Run model's decoder (no lm_head) over input_ids (n,) appended to `cache`, at the given positions (n,) and
    with an explicit (1, 1, n, cache_len + n) bool mask. Returns the final-norm hidden states (n, H): the features
    EAGLE heads read, and what the lm_head turns into logits."""
    decoder = model.get_decoder()
    out = decoder(input_ids=input_ids[None], attention_mask=attention_mask, position_ids=positions[None],
                  **cache_kwargs(decoder, cache))
    return out.last_hidden_state[0]
