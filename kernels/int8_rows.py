"""8-bit weights times 7-bit activations rounded per row, on CPUs with AVX2 and no VNNI (int8_rows.cpp has the math):
the target's int8 x int8 product at the pace of its weight reads. FBGEMM's operator, which the other CPUs keep, costs
40-70 us a call there whatever the layer's size.

A C++ extension built on first use like eagle_fsd.kernels.int4_rows (a C++ compiler and ninja; cached as
cpp_build says). `int8_rows_reference` is the same product in float64, for tests.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from .cpp_build import load_extension
from .int4_rows import ISA_FLAGS, cpu_flags, runnable_isas

LANES, CHUNK = 16, 4  # channels per block, inputs per chunk
LEVELS, ZERO = 63, 64  # r and z of 7-bit activations: u = round(r x / max |x|) + z in 1..127


@functools.cache
def _extension():
    return load_extension("eagle_fsd_int8_rows_avx2", Path(__file__).with_name("int8_rows.cpp"),
                          ["-O3", "-fopenmp", *ISA_FLAGS["avx2"][1]], ["-fopenmp"])


@functools.cache
def int8_rows_runnable() -> bool:
    """This CPU has AVX2 (FMA, F16C) and the kernel compiles here."""
    if "avx2" not in runnable_isas(cpu_flags(), ""):
        return False
    try:
        _extension()
    except Exception:  # no compiler, no ninja, headers missing: FBGEMM stays
        return False
    return True


def int8_rows_available() -> bool:
    """The target's int8 layers run here rather than FBGEMM: the CPU's best build is AVX2 (no AVX-512 VNNI, or torch
    capped at AVX2 by ATEN_CPU_CAPABILITY), so its int8 layers take 7-bit activations, and the kernel compiles."""
    isas = runnable_isas(cpu_flags(), torch.backends.cpu.get_cpu_capability())
    return bool(isas) and isas[0] == "avx2" and int8_rows_runnable()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (n, k) -> codes q (n, k) int8 in -127..127 and scales s (n) fp32, W ~ s q per output channel:
    s = max_j |W_oj| / 127."""
    w = weight.detach().float()
    scale = w.abs().amax(1).clamp(min=1e-12) / 127
    q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q, scale


def pack_int8_rows(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes q (n, k) int8 and scales (n) in the kernel's layout: packed (ceil(n / 16), ceil(k / 4), 64) int8,
    Q = sum_j q_oj and the scales, both (ceil(n / 16) * 16); channels and inputs past n and k are zero."""
    n, k = q.shape
    blocks, chunks = -(-n // LANES), -(-k // CHUNK)
    q = F.pad(q, (0, chunks * CHUNK - k, 0, blocks * LANES - n))
    qsum = q.sum(1, dtype=torch.int32)
    # q[b, lane, c, t] -> [b, c, lane, t]: byte 4 lane + t of chunk c = input 4 c + t of that lane
    packed = q.reshape(blocks, LANES, chunks, CHUNK).permute(0, 2, 1, 3).reshape(blocks, chunks, LANES * CHUNK)
    return packed.contiguous(), qsum, F.pad(scale.float(), (0, blocks * LANES - n))


def round_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, k) -> (u - z, a): u = round(r x / m) + z, m = max |x| per row, a = m / r (the kernel's rounding)."""
    x = x.float()
    peak = x.abs().amax(1, keepdim=True).clamp(min=1e-30)
    return torch.round(x * (LEVELS / peak)), peak / LEVELS


def int8_rows_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias=None) -> torch.Tensor:
    """The kernel's product in float64: a_i sum_j s_o q_oj (u_ij - z) (+ bias)."""
    v, a = round_rows(x.reshape(-1, x.shape[-1]))
    y = (v.double() @ (q.double() * scale.double().unsqueeze(1)).T) * a.double()
    return y if bias is None else y + bias.double()


def int8_rows_linear(x: torch.Tensor, packed: torch.Tensor, qsum: torch.Tensor, scale: torch.Tensor,
                     out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., k) fp32 -> (..., out_features) fp32 through `pack_int8_rows`' weight; bias (None, or fp32 padded to the
    packed channels like the scales)."""
    rows = x.reshape(-1, x.shape[-1])
    y = _extension().int8_rows_linear(rows.float(), packed, qsum, scale, torch.empty(0) if bias is None else bias)
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    return y.reshape(*x.shape[:-1], out_features)


def int8_rows_entry() -> int:
    """The address of the kernel's C entry (int8_rows_into), which eagle_fsd.kernels.decoder_glue's layer loop calls."""
    return _extension().entry()
