"""The elementwise steps between a decoder layer's products (RMSNorm, rotary embedding, SiLU-gated product) as one
C++ call each, for forwards of a few rows on a CPU (decoder_glue.cpp has the math).

A C++ extension built on first use by torch.utils.cpp_extension (a C++ compiler and ninja; cached under
TORCH_EXTENSIONS_DIR). `decoder_glue_available()` says whether it builds here; the `*_reference` functions are the
same steps in float64, for tests.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.cache
def _extension():
    from torch.utils import cpp_extension
    source = Path(__file__).with_name("decoder_glue.cpp")
    # -fopenmp: at::parallel_for (a prompt's rows) is OpenMP in a header, serial without it
    return cpp_extension.load(name="eagle_fsd_decoder_glue", sources=[str(source)], verbose=False,
                              extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])


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
