"""Thin glue to transformers: one forward of a decoder over new tokens on top of a cache, with an explicit mask."""
from __future__ import annotations

import inspect
from functools import lru_cache

import torch

from eagle_fsd.attention import ForwardState, attention_fields
from eagle_fsd.cache import TreeCache
from eagle_fsd.fused_decoder import fused_decoder_forward
from eagle_fsd.plan import ModelRun

FLOAT = ModelRun()  # a float model through transformers' layers, attention "auto"


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


def key_positions(cache, positions: torch.Tensor) -> torch.Tensor:
    """Positions of every key a forward appending tokens at `positions` (n,) attends to, (cache_len + n,): tracked by
    a TreeCache (tree entries sit at committed + depth, not at their slot); any other cache holds slot i = position i."""
    if isinstance(cache, TreeCache):
        return cache.track_positions(positions)
    past = 0 if cache is None else cache.get_seq_length()
    return torch.cat([torch.arange(past, device=positions.device), positions])


def forward_state(model, cache, positions: torch.Tensor, run: ModelRun) -> ForwardState:
    """The state one forward's layers share: the backend, float64 attention or not, and for a model with sliding
    layers the positions of the forward's queries and keys (no layer slides without a window:
    attention.config_window)."""
    if not attention_fields(model.config)["sliding_window"]:
        return ForwardState(run.backend, run.fp64_attention)
    return ForwardState(run.backend, run.fp64_attention, positions, key_positions(cache, positions))


def decoder_outputs(model, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor, positions: torch.Tensor,
                    run: ModelRun = FLOAT, feature_layers: tuple[int, ...] | None = None):
    """Run model's decoder (no lm_head) over input_ids (n,) appended to `cache`, at the given positions (n,) and
    with an explicit (1, 1, n, cache_len + n) bool mask, as its run plan says (`run`: the fused forward or
    transformers' layers; attention backend "auto", "sdpa" or "triton", eagle_fsd.attention). Returns (final-norm
    hidden states (n, H): what the lm_head turns into logits and what EAGLE-1/2 heads read, drafter features): the
    features are the final hidden states again, or with
    `feature_layers` (EAGLE-3) cat(hidden state entering layer i for i in feature_layers), (n, len * H).

    Sliding-window layers see the mask cut to their window (eagle_fsd.attention). Models with an attention kind the
    engine does not implement are refused once, where the engine and the drafters are built
    (eagle_fsd.attention.check_attention_support), not at every forward."""
    if run.fused:  # fewer operators (fp32 Llama, Qwen2): eagle_fsd.fused_decoder says what equals what
        if feature_layers is None:
            last = fused_decoder_forward(model, input_ids, cache, attention_mask, positions, run)
            return last, last
        return fused_decoder_forward(model, input_ids, cache, attention_mask, positions, run, feature_layers)
    decoder = model.get_decoder()
    state = forward_state(model, cache, positions, run)
    out = decoder(input_ids=input_ids[None], attention_mask=attention_mask, position_ids=positions[None],
                  eagle_fsd_forward=state, output_hidden_states=feature_layers is not None,
                  **cache_kwargs(decoder, cache))
    last = out.last_hidden_state[0]
    if feature_layers is None:
        return last, last
    return last, torch.cat([out.hidden_states[i][0] for i in feature_layers], dim=-1)


def decoder_forward(model, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor, positions: torch.Tensor,
                    run: ModelRun = FLOAT) -> torch.Tensor:
    """The final-norm hidden states (n, H) of decoder_outputs."""
    return decoder_outputs(model, input_ids, cache, attention_mask, positions, run)[0]
