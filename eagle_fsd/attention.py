"""The attention function every model of the engine runs through, registered with transformers.

The engine hands each forward an explicit 4-D bool mask (B, 1, N, L): the committed prefix is fully visible and the
last N columns carry the tree mask (ancestor-or-self; a lower triangle for a causal block). Backends:
  "sdpa"   -- SDPA with that mask (the CPU default), grouped key/value heads read in place (`sdpa`);
  "triton" -- eagle_fsd.kernels.tree_attention, which reads only the (N, N) tree block, bit-packed (the CUDA
              default; on CPU it runs under TRITON_INTERPRET=1, for tests).
With "auto", the kernel serves forwards on top of a cached prefix (tree verification, draft levels, catch-up) and
SDPA serves prompt prefill (no prefix: SDPA's causal kernels are faster there).

One forward, one state. `eagle_fsd.hf.decoder_forward` (and the EAGLE head's forward) create a `ForwardState` per
forward and pass it as the keyword argument `eagle_fsd_forward`; transformers' models hand their extra keyword
arguments (`**kwargs: TransformersKwargs`) from the model's forward through every decoder layer and attention module
to the registered attention function, so each layer of that forward, and only those, sees it. It holds the backend
("auto", "sdpa" or "triton", chosen by the caller), and what the forward's layers compute once and share: the packed
tree block and the masks cut to sliding windows. Nothing lives at module level: two models or threads never share a
mask.

Sliding-window layers. transformers passes an explicit 4-D mask through unchanged, so a model's sliding window is
not in the engine's mask. For a model with a window decoder_forward puts the positions of the forward's queries (N,)
and keys (L,) in its state; a layer with window w then cuts the mask to
    query at position p sees key at position k  iff  mask[p, k] and p - k < w,
transformers' convention (masking_utils.sliding_window_overlay: kv_idx > q_idx - w). A layer's window is the
`sliding_window` argument its model passes to the attention function (None on full layers) or, for models that do
not pass it, the one its config implies (`layer_windows`). Sliding layers always run on SDPA: the Triton kernel
treats the whole prefix as visible, so "auto" and "triton" fall back to SDPA on them (full layers keep the kernel).
Outside decoder_forward (e.g. transformers' own generate) no state is passed: backend "auto", and the mask
transformers built, which already holds the window, is used as given.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask
from transformers.utils import is_torch_greater_or_equal

ATTENTION_NAME = "eagle_fsd"
BACKENDS = ("auto", "sdpa", "triton")
FULL, SLIDING = "full_attention", "sliding_attention"
SUPPORTED_LAYER_TYPES = (FULL, SLIDING)
# attention fields a decoder config may lack, with the values that mean plain causal attention
OPTIONAL_FIELDS = {"sliding_window": None, "layer_types": None, "attention_chunk_size": None,
                   "use_bidirectional_attention": False, "is_causal": True}


def attention_fields(config) -> dict:
    """The config's OPTIONAL_FIELDS, each as set or its default."""
    return {name: getattr(config, name, default) for name, default in OPTIONAL_FIELDS.items()}


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"attention={backend!r} is not one of {BACKENDS}")


# ---------------------------------------------------------------- which layers slide, and by how much
def config_window(config, layer_idx: int) -> int | None:
    """The sliding window of layer `layer_idx` as the config describes it, None for full attention: with
    `layer_types`, config.sliding_window on "sliding_attention" layers only; without, config.sliding_window on every
    layer (Mistral-style). A window of 0 means none (Qwen2-MoE's "off")."""
    fields = attention_fields(config)
    window, types = fields["sliding_window"] or None, fields["layer_types"]
    if types is None:
        return window
    return window if types[layer_idx] == SLIDING else None


def check_attention_support(config) -> None:
    """Refuse (ValueError naming the layer and the reason) models whose attention the engine cannot reproduce exactly:
    layer types other than full / sliding causal attention, chunked or bidirectional attention, a bad window.
    Cheap enough to run at every forward (a set of layer types and a few attributes)."""
    fields = attention_fields(config)
    types = fields["layer_types"] or ()
    supported = set(SUPPORTED_LAYER_TYPES)
    if not supported.issuperset(types):
        i, kind = next((i, t) for i, t in enumerate(types) if t not in supported)
        raise ValueError(f"layer {i} of this {config.model_type!r} model has attention type {kind!r}; eagle-fsd "
                         f"supports only {SUPPORTED_LAYER_TYPES} (causal, optionally sliding-window), so this "
                         "model cannot be verified losslessly: use plain transformers generate for it")
    if fields["attention_chunk_size"]:
        raise ValueError(f"this {config.model_type!r} model uses chunked attention (attention_chunk_size="
                         f"{config.attention_chunk_size}); eagle-fsd supports only full and sliding-window causal "
                         "attention: use plain transformers generate for it")
    if fields["use_bidirectional_attention"] or not fields["is_causal"]:
        raise ValueError(f"this {config.model_type!r} model attends bidirectionally; speculative decoding needs a "
                         "causal LM")
    window = fields["sliding_window"]
    if window and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window={window!r} must be a positive int (or None for full attention)")
    if SLIDING in types and not window:
        raise ValueError(f"layer {types.index(SLIDING)} is 'sliding_attention' but sliding_window={window!r}: set "
                         "config.sliding_window (and use_sliding_window=True for Qwen2) or mark the layer "
                         "'full_attention'")


def layer_windows(config) -> list[int | None]:
    """Per-layer sliding windows (None = full causal attention) of a supported decoder config."""
    check_attention_support(config)
    types = attention_fields(config)["layer_types"]
    n = config.num_hidden_layers if types is None else len(types)
    return [config_window(config, i) for i in range(n)]


def module_window(module, kwargs: dict) -> int | None:
    """The window of the layer calling the attention function: the `sliding_window` its model passes (the model's
    own per-layer truth: Qwen2 passes None on full layers, Mistral its window on all), else the config's."""
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"] or None
    layer_idx = getattr(module, "layer_idx", None)
    return None if layer_idx is None else config_window(module.config, layer_idx)


def within_window(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """(N, L) bool: a query at position p may see a key at position k only if p - k < window."""
    return (query_positions[:, None] - key_positions[None, :]) < window


# ---------------------------------------------------------------- what one forward's layers share
@dataclass
class ForwardState:
    """Owned by one forward (eagle_fsd.hf.decoder_forward creates it and hands it to every layer as the keyword
    argument `eagle_fsd_forward`, which transformers' models pass through to the attention function): the backend,
    the positions of the forward's queries (N,) and keys (L,) for its sliding-window layers (None: the mask is used
    as given), and what its layers compute once and share: the mask cut to each window, the packed tree block."""

    backend: str = "auto"
    fp64: bool = False  # attend in float64 on a CPU (eagle_fsd.plan.ModelRun.fp64_attention)
    query_positions: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> the forward's mask cut to it
    packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (mask, its bit-packed (B, N, W) tree block)



def windowed_mask(state: ForwardState, attention_mask: torch.Tensor | None, window: int, query_len: int,
                  key_len: int):
    """The mask of a layer with a sliding window: the engine's mask cut to the window (once per forward and window),
    or transformers' own mask when the forward published no positions (transformers built it with the window)."""
    query, key = state.query_positions, state.key_positions
    if query is None:
        return attention_mask
    if attention_mask is None or tuple(attention_mask.shape[-2:]) != (query_len, key_len) \
            or query.numel() != query_len or key.numel() != key_len:
        raise RuntimeError(f"sliding-window layer got a mask of shape "
                           f"{None if attention_mask is None else tuple(attention_mask.shape)} for {query_len} queries "
                           f"over {key_len} keys, but the running forward published {query.numel()} query and "
                           f"{key.numel()} key positions; run engine forwards through eagle_fsd.hf.decoder_forward")
    if window not in state.windowed:
        visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        state.windowed[window] = visible & within_window(query, key, window)
    return state.windowed[window]


# ---------------------------------------------------------------- the attention function
SDPA_GQA = is_torch_greater_or_equal("2.5")  # torch's SDPA takes grouped key/value heads as they are (enable_gqa)


def sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA over the engine's explicit mask. On a CPU, grouped-query heads go to torch's SDPA as they are: query head
    h reads key/value head h // (H / H_kv). transformers' SDPA path copies each key/value head once per query head
    whenever a masked forward holds several queries (its masked GQA kernels are for other devices), and that copy of
    the whole cache costs more than the attention on a few CPU cores; the result is the same to the bit. One path
    for every query count: a plain decoding step and a tree verification attend alike."""
    if (not SDPA_GQA or attention_mask is None or query.device.type != "cpu" or query.shape[1] == key.shape[1]
            or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None

def _use_kernel(backend: str, query: torch.Tensor, key: torch.Tensor) -> bool:
    if backend == "auto":
        return query.device.type == "cuda" and key.shape[2] > query.shape[2]
    return backend == "triton"


def packed_tree_block(state: ForwardState, attention_mask: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """The bit-packed (B, N, W) tree block of a (B, 1, N, L) bool mask (no mask: causal), packed once per forward:
    every full layer of a forward gets the same mask."""
    from eagle_fsd.kernels import pack_tree_mask

    if attention_mask is None:
        return pack_tree_mask(torch.ones(n, n, dtype=torch.bool, device=device).tril())
    if state.packed is None or state.packed[0] is not attention_mask:
        block = attention_mask[:, 0, :, -n:]
        if block.dtype != torch.bool:
            block = block == 0  # additive float mask: 0 = visible
        state.packed = (attention_mask, pack_tree_mask(block))
    return state.packed[1]


def eagle_fsd_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        eagle_fsd_forward: ForwardState | None = None, **kwargs):
    """Outside an engine forward (no `eagle_fsd_forward`, e.g. transformers' own generate): backend "auto" and the
    mask as transformers built it. A forward whose state asks for float64 (a target with row-rounded activations,
    eagle_fsd.target_quant) attends in float64 on CPU and rounds the result to its dtype: the same value for a query
    whatever else the forward holds (fp32 sums run in an order that depends on the number of queries and keys, and the
    next layer's 8-bit rounding would magnify a last-bit difference into a different token)."""
    state = ForwardState() if eagle_fsd_forward is None else eagle_fsd_forward
    kwargs |= {"scaling": scaling, "dropout": dropout}
    if state.fp64 and query.dtype == torch.float32 and query.device.type == "cpu":
        out, _ = _attention(module, query.double(), key.double(), value.double(), attention_mask, state, "sdpa",
                            **kwargs)
        return out.float(), None
    return _attention(module, query, key, value, attention_mask, state, state.backend, **kwargs)


def _attention(module, query, key, value, attention_mask, state: ForwardState, backend: str, **kwargs):
    window = module_window(module, kwargs)
    if window is not None:  # sliding layer: SDPA on the windowed mask (the kernel sees the whole prefix)
        attention_mask = windowed_mask(state, attention_mask, window, query.shape[2], key.shape[2])
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    if _use_kernel(backend, query, key):
        from eagle_fsd.kernels import tree_attention

        tree_mask = packed_tree_block(state, attention_mask, query.shape[2], query.device)
        return tree_attention(query, key, value, tree_mask, scale=kwargs["scaling"]), None
    return sdpa(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION_NAME, eagle_fsd_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
