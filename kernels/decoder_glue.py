"""The steps between a decoder layer's products (RMSNorm, rotary embedding, SiLU-gated product, and attention over
a cached prefix) as one C++ call each, for forwards of a few rows on a CPU (decoder_glue.cpp has the math).

A C++ extension built on first use by torch.utils.cpp_extension (a C++ compiler and ninja; cached as
cpp_build says), for the widest vector instructions this CPU runs (AVX-512, AVX2, or none), capped like the
int4 kernel by ATEN_CPU_CAPABILITY. Built with -ffp-contract=off: no multiply-add is fused, so every product and sum
rounds as written, whichever build runs. `decoder_glue_available()` says whether it builds here; the `*_reference`
functions are the same steps in float64, for tests.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from .cpp_build import load_extension
from .int4_rows import CAPABILITY_ISAS, cpu_flags


VECTOR_FLAGS = {"avx512": ("avx512f", "-mavx512f"), "avx2": ("avx2", "-mavx2")}  # build: (CPU flag, compiler flag)


@functools.cache
def vector_isa() -> str:
    """The build this CPU runs: "avx512", "avx2" or "generic", within torch's CPU capability."""
    flags, capability = cpu_flags(), torch.backends.cpu.get_cpu_capability().upper()
    allowed = CAPABILITY_ISAS.get(capability, tuple(VECTOR_FLAGS))
    return next((isa for isa, (flag, _) in VECTOR_FLAGS.items() if isa in allowed and flag in flags), "generic")


@functools.cache
def _build(isa: str):
    vector = [VECTOR_FLAGS[isa][1]] if isa in VECTOR_FLAGS else []
    # -fopenmp: at::parallel_for is OpenMP in a header, serial without it
    return load_extension(f"eagle_fsd_decoder_glue_{isa}", Path(__file__).with_name("decoder_glue.cpp"),
                          ["-O3", "-fopenmp", "-ffp-contract=off", *vector], ["-fopenmp"])


def _extension():
    return _build(vector_isa())


@functools.cache
def decoder_glue_available() -> bool:
    """The extension compiles here (a C++ compiler and ninja)."""
    try:
        _extension()
    except Exception:  # no compiler, no ninja, headers missing: PyTorch's operators stay
        return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (rows, width) fp32 -> weight x / sqrt(mean x^2 + eps), per row."""
    return _extension().rms_norm(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """x (rows, heads * dim) fp32, cos and sin (rows, dim) -> x cos + rotate_half(x) sin per head, as
    (1, heads, rows, dim)."""
    return _extension().rope(x, cos, sin, heads)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, (rows, width)."""
    return _extension().silu_mul(gate, up)


def rows_forward(embeds: torch.Tensor, calls: list[list[int]], weights: list[torch.Tensor], norms: list[torch.Tensor],
                 eps: float, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                 start: int, mask: torch.Tensor, heads: int, kv_heads: int, scale: float,
                 intermediate: int) -> torch.Tensor:
    """A Llama-shaped decoder's forward of the rows embeds (n, hidden) on top of a cached prefix, in one call: per
    layer rms_norm, q | k | v product, attend, o product, residual, rms_norm, gate | up product, silu_mul, down
    product, residual; then the final rms_norm (returned, (n, hidden)). The products are kernel calls by address
    (int4_rows_entry, int8_rows_entry): `calls` rows [layer, part (0 qkv, 1 o, 2 gate | up, 3 down), entry, k,
    blocks, inner, column offset], four `weights` per call (packed, qsum, scale, bias; empty where unused); `norms`
    two per layer then the final one; keys and values one cache per layer, written at slots start .. start + n - 1."""
    return _extension().rows_forward(embeds, calls, weights, norms, eps, cos, sin, keys, values, start, mask, heads,
                                     kv_heads, scale, intermediate)


def rms_norm_like_transformers(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' fp32 RMSNorm of Llama and Qwen2 (its operators, the same bits), one call from Python."""
    return _extension().rms_norm_aten(x, weight, eps)


def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           start: int, mask: torch.Tensor, heads: int, kv_heads: int, scale: float) -> torch.Tensor:
    """One layer's attention for the rows of qkv (n, (heads + 2 kv_heads) dim) fp32, q | k | v side by side: their
    keys (roped by cos, sin (n, dim)) and values go to cache slots start .. start + n - 1 of keys, values
    (1, kv_heads, max_len, dim), fp32 or fp64; row i attends to slot j where mask[i, j] ((n, start + n) bool).
    Returns (n, heads * dim) fp32, computed in the cache's type, each row over its visible keys alone in slot
    order."""
    return _extension().attend(qkv, cos, sin, keys, values, start, mask, heads, kv_heads, scale)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of logits (rows, V) fp32, larger first (equal ones by column), as log-probabilities
    logit - logsumexp(row): (log-probs (rows, k) fp32, columns (rows, k) int64)."""
    logprobs, columns = _extension().top_logprobs(logits, k)
    return logprobs, columns


def attend_reference(qkv, cos, sin, keys, values, start, mask, heads, kv_heads, scale):
    """attend in float64 with torch operators, on copies of the cache: (output (n, heads * dim), keys, values)."""
    n, dim = cos.shape
    keys, values = keys.clone(), values.clone()
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], 1)
    keys[0, :, start:start + n] = rope_reference(k, cos, sin, kv_heads)[0].to(keys.dtype)
    values[0, :, start:start + n] = v.reshape(n, kv_heads, dim).transpose(0, 1).to(values.dtype)
    visible = mask
    group = heads // kv_heads
    key, value = keys[0, :, :start + n].double(), values[0, :, :start + n].double()
    scores = rope_reference(q, cos, sin, heads)[0] @ key.repeat_interleave(group, 0).transpose(1, 2) * scale
    weights = scores.masked_fill(~visible, -torch.inf).softmax(-1)
    out = weights @ value.repeat_interleave(group, 0)  # heads, n, dim
    return out.transpose(0, 1).reshape(n, heads * dim), keys, values


def rms_norm_reference(x, weight, eps):
    x = x.double()
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_reference(x, cos, sin, heads):
    rows, dim = cos.shape
    x = x.double().reshape(rows, heads, dim).transpose(0, 1)  # heads, rows, dim
    rotated = torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1)
    return (x * cos.double() + rotated * sin.double())[None]


def silu_mul_reference(gate, up):
    gate = gate.double()
    return gate * torch.sigmoid(gate) * up.double()
