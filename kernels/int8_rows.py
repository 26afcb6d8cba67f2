"""8-bit weights times activations rounded per row (int8_rows.cpp has the math): the target's int8 x int8 product at
the pace of its weight reads, where FBGEMM's operator costs tens of microseconds a call whatever the layer's size.
Two builds: AVX-512 VNNI with 8-bit activations, AVX2 with 7-bit ones (no VNNI: 8-bit products would saturate).

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
BUILDS = {8: "avx512_vnni", 7: "avx2"}  # activation bits -> the build that takes them


def levels(bits: int) -> tuple[int, int]:
    """(r, z) of `bits`-bit activations: u = round(r x / max |x|) + z in 1..2z - 1."""
    r = 2 ** (bits - 1) - 1
    return r, r + 1


@functools.cache
def _extension(isa: str):
    return load_extension(f"eagle_fsd_int8_rows_{isa}", Path(__file__).with_name("int8_rows.cpp"),
                          ["-O3", "-fopenmp", *ISA_FLAGS[isa][1]], ["-fopenmp"])


def _build(bits: int) -> str:
    if bits not in BUILDS:
        raise ValueError(f"activation bits {bits!r}: int8_rows has builds for {sorted(BUILDS)}")
    return BUILDS[bits]


@functools.cache
def int8_rows_runnable(bits: int) -> bool:
    """This CPU has the instructions of the build for `bits`-bit activations, and it compiles here."""
    if _build(bits) not in runnable_isas(cpu_flags(), ""):
        return False
    try:
        _extension(_build(bits))
    except Exception:  # no compiler, no ninja, headers missing: FBGEMM stays
        return False
    return True


def int8_rows_available(bits: int) -> bool:
    """The target's int8 layers with `bits`-bit activations run here rather than FBGEMM: the build for them is
    runnable within torch's CPU capability (ATEN_CPU_CAPABILITY=avx2 rules out the VNNI build) and compiles."""
    allowed = runnable_isas(cpu_flags(), torch.backends.cpu.get_cpu_capability())
    return _build(bits) in allowed and int8_rows_runnable(bits)


def int8_rows_builds() -> list[str]:
    """The builds the target's int8 layers may run here (`int8_rows_available`), by name: what a cache of products or
    timings made with them is keyed by."""
    return [isa for bits, isa in BUILDS.items() if int8_rows_available(bits)]


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


def round_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, k) -> (u - z, a): u = round(r x / m) + z, m = max |x| per row, a = m / r (the kernel's rounding)."""
    r, _ = levels(bits)
    x = x.float()
    peak = x.abs().amax(1, keepdim=True).clamp(min=1e-30)
    return torch.round(x * (r / peak)), peak / r


def int8_rows_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias=None, *,
                        bits: int) -> torch.Tensor:
    """The kernel's product in float64: a_i sum_j s_o q_oj (u_ij - z) (+ bias)."""
    v, a = round_rows(x.reshape(-1, x.shape[-1]), bits)
    y = (v.double() @ (q.double() * scale.double().unsqueeze(1)).T) * a.double()
    return y if bias is None else y + bias.double()


def int8_rows_linear(x: torch.Tensor, packed: torch.Tensor, qsum: torch.Tensor, scale: torch.Tensor,
                     out_features: int, bias: torch.Tensor | None = None, *, bits: int) -> torch.Tensor:
    """x (..., k) fp32 -> (..., out_features) fp32 through `pack_int8_rows`' weight, activations rounded to `bits`
    (the build taking them); bias (None, or fp32 padded to the packed channels like the scales)."""
    rows = x.reshape(-1, x.shape[-1])
    y = _extension(_build(bits)).int8_rows_linear(rows.float(), packed, qsum, scale,
                                                  torch.empty(0) if bias is None else bias)
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    return y.reshape(*x.shape[:-1], out_features)


def int8_rows_entry(bits: int) -> int:
    """The address of the C entry (int8_rows_into) of the build for `bits`, which eagle_fsd.kernels.decoder_glue's
    layer loop calls."""
    return _extension(_build(bits)).entry()
