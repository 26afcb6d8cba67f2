"""A preallocated KV cache that tree verification can write into and then compact to the accepted path.

Layout per layer: keys/values (B, H_kv, max_len, D). Slots [0, length) hold committed tokens; a verification
forward appends the tree's N tokens at [length, length + N); `keep(start, idx)` then moves the accepted nodes'
entries (slots start + idx) to [start, start + len(idx)) and drops the rest. Nothing is ever reallocated.

Storage dtype: as the keys arrive, or float64 for a model that attends in float64 through transformers' layers (an
exact quantized target that eagle_fsd.fused_decoder does not run: eagle_fsd.plan.ModelRun.kv_dtype): each new key is
widened once when stored instead of the whole cache at every layer of every forward; fp32 -> fp64 is exact, so
attention sees the same numbers. The fused decoder attends in fp32 over an fp32 cache instead.

Positions: committed slot i holds the token at position i, but tree entries do not (tree node j sits at position
committed + depth(j)). Sliding-window attention needs every key's position, so TreeCache can track them
(`track_positions`, called by eagle_fsd.hf.decoder_forward for models with sliding layers only).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from eagle_fsd.plan import ModelRun


class PreallocatedLayer(DynamicLayer):
    """One layer's fixed-size buffer. Subclasses DynamicLayer only to inherit the rest of the layer protocol."""

    is_croppable = True

    def __init__(self, max_len: int, storage_dtype: torch.dtype | None = None):
        super().__init__()
        self.max_len = max_len
        self.storage_dtype = storage_dtype  # None: the dtype the first keys arrive in
        self.length = 0

    def lazy_initialization(self, key_states, value_states):
        batch, heads, _, dim = key_states.shape
        self.device = key_states.device
        dtype = self.storage_dtype or key_states.dtype
        self.keys = key_states.new_zeros(batch, heads, self.max_len, dim, dtype=dtype)
        self.values = value_states.new_zeros(batch, value_states.shape[1], self.max_len, value_states.shape[-1],
                                             dtype=dtype)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: {end} tokens > preallocated {self.max_len}")
        self.keys[:, :, self.length:end] = key_states
        self.values[:, :, self.length:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.max_len

    def crop(self, max_length: int) -> None:
        self.length = max_length if max_length >= 0 else self.length + max_length

    def reset(self) -> None:
        self.length = 0

    def keep(self, start: int, idx: torch.Tensor) -> None:
        """Compact: slots start + idx[i] -> start + i, for the accepted path idx (ascending, idx[i] >= i)."""
        if not self.is_initialized:
            return
        src = start + idx
        n = idx.numel()
        # index_select copies first, so overlapping source/destination ranges are safe.
        self.keys[:, :, start:start + n] = self.keys.index_select(2, src)
        self.values[:, :, start:start + n] = self.values.index_select(2, src)
        self.length = start + n


class TreeCache(Cache):
    """A transformers `Cache` of `PreallocatedLayer`s, sized prompt + max_new_tokens + tree (not the model context)."""

    def __init__(self, num_layers: int, max_len: int, storage_dtype: torch.dtype | None = None):
        super().__init__(layers=[PreallocatedLayer(max_len, storage_dtype) for _ in range(num_layers)])
        self.max_len = max_len
        self.positions: torch.Tensor | None = None  # (max_len,) position of each slot's token, once tracked

    @classmethod
    def for_model(cls, model, max_len: int, run: ModelRun) -> TreeCache:
        """A cache for every layer of `model`, stored in the dtype its run plan names (float64 where it attends in
        float64 through transformers' layers)."""
        return cls(model.config.num_hidden_layers, max_len, run.kv_dtype if model.device.type == "cpu" else None)

    def track_positions(self, new_positions: torch.Tensor) -> torch.Tensor:
        """Record the positions (n,) of the tokens the next forward appends and return the positions of all the keys
        that forward attends to, (length + n,). Before the first call slot i is taken to hold position i (true of a
        committed prefix)."""
        start = self.get_seq_length()
        end = start + new_positions.numel()
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: {end} tokens > preallocated {self.max_len}")
        if self.positions is None:
            self.positions = torch.arange(self.max_len, device=new_positions.device)
        self.positions[start:end] = new_positions
        return self.positions[:end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def crop(self, max_length: int) -> None:
        for layer in self.layers:
            layer.crop(max_length)

    def keep(self, start: int, idx: torch.Tensor) -> None:
        n = idx.numel()
        if n and int(idx[-1]) == n - 1:  # ascending with idx[i] >= i: idx is 0 .. n - 1, already in place (a chain)
            self.crop(start + n)
            return
        for layer in self.layers:
            layer.keep(start, idx)
        if self.positions is not None:  # the kept entries' positions move with them (indexing copies first)
            self.positions[start:start + idx.numel()] = self.positions[start + idx]
