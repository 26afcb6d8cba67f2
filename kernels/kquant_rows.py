"""A GGUF file's own Q4_K and Q6_K weights times 8-bit activations rounded per row, on CPUs with AVX-512 VNNI or with
AVX2 (kquant_rows.cpp has the math and the layout; both builds give the same bits): a quantized target read at the
file's bytes, 4.5 and 6.5625 bits a weight, where int4_rows takes 5 and int8_rows 8.

Raw tensors are a GGUF tensor's bytes, (n, k / 256 * block bytes) uint8, one row of consecutive super-blocks per
output channel. A C++ extension built on first use like eagle_fsd.kernels.int4_rows, on the build int4_rows would
pick (`kquant_rows_isa`); `kquant_rows_reference` is the same product in float64, for tests.
"""
from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import torch

from .cpp_build import load_extension
from .int4_rows import ISA_FLAGS, building_isa, cpu_flags, round_rows

KINDS = ("q4_k", "q6_k")
SUPER = 256  # inputs per super-block
BLOCK_BYTES = {"q4_k": 144, "q6_k": 210}  # bytes per super-block in the file
PACKED_BYTES = {"q4_k": 2368, "q6_k": 3360}  # bytes per 16 channels x one super-block in the kernel's layout
GGML_TYPES = {"q4_k": gguf.GGMLQuantizationType.Q4_K, "q6_k": gguf.GGMLQuantizationType.Q6_K}
LANES = 16  # channels per block
_KIND_ID = {"q4_k": 4, "q6_k": 6}  # the C entry's name for a kind


def _blocks(raw, kind: str) -> torch.Tensor:
    """raw (n, k / 256 * block bytes) -> (n, k / 256, block bytes) uint8."""
    _kind(kind)
    if isinstance(raw, np.ndarray):  # a GGUFReader tensor's .data is a read-only memory map: copied
        raw = torch.from_numpy(np.require(raw, requirements=["C", "W"]))
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % BLOCK_BYTES[kind]:
        raise ValueError(f"{kind}: raw bytes (n, k / 256 * {BLOCK_BYTES[kind]}) uint8, got {tuple(raw.shape)} "
                         f"{raw.dtype}")
    return raw.reshape(raw.shape[0], -1, BLOCK_BYTES[kind])


def _half(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) bytes -> (...) fp16, little-endian as the file."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def decode_q4k(raw):
    """Q4_K bytes -> codes q (n, k) uint8 0..15, sc and mn (n, k / 32) uint8 0..63, d and dmin (n, k / 256) fp16:
    W = d sc q - dmin mn per sub-block of 32."""
    blocks = _blocks(raw, "q4_k")
    n, groups = blocks.shape[:2]
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    s0, s1, s2 = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = torch.cat([s0 & 63, (s2 & 15) | ((s0 >> 6) << 4)], -1)
    mn = torch.cat([s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)], -1)
    qs = blocks[..., 16:].reshape(n, groups, 4, 1, 32)  # bytes 32c + l: inputs 64c + l (low), 64c + 32 + l (high)
    q = torch.cat([qs & 15, qs >> 4], 3)
    return q.reshape(n, -1), sc.reshape(n, -1), mn.reshape(n, -1), d, dmin


def encode_q4k(q, sc, mn, d, dmin) -> torch.Tensor:
    """The inverse of decode_q4k: raw (n, k / 256 * 144) uint8."""
    n, k = q.shape
    groups = k // SUPER
    sc, mn = sc.to(torch.uint8).reshape(n, groups, 8), mn.to(torch.uint8).reshape(n, groups, 8)
    s0 = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    s1 = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    s2 = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    q = q.to(torch.uint8).reshape(n, groups, 4, 2, 32)
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(n, groups, 128)
    heads = [t.half().contiguous().view(torch.uint8).reshape(n, groups, 2) for t in (d, dmin)]
    return torch.cat([*heads, s0, s1, s2, qs], 2).reshape(n, -1)


def decode_q6k(raw):
    """Q6_K bytes -> codes q (n, k) uint8 0..63, sc (n, k / 16) int8, d (n, k / 256) fp16: W = d sc (q - 32) per
    sub-block of 16."""
    blocks = _blocks(raw, "q6_k")
    n, groups = blocks.shape[:2]
    ql = blocks[..., :128].reshape(n, groups, 2, 1, 64)  # half h, byte l: inputs 128h + l (low), 128h + 64 + l (high)
    qh = blocks[..., 128:192].reshape(n, groups, 2, 1, 32)  # bits 2f, 2f + 1 of byte l: input 128h + 32f + l
    low = torch.cat([ql & 15, ql >> 4], 3).reshape(n, groups, 2, 128)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
    high = ((qh >> shifts) & 3).reshape(n, groups, 2, 128)
    q = low | (high << 4)
    return q.reshape(n, -1), blocks[..., 192:208].contiguous().view(torch.int8).reshape(n, -1), \
        _half(blocks[..., 208:210])


def encode_q6k(q, sc, d) -> torch.Tensor:
    """The inverse of decode_q6k: raw (n, k / 256 * 210) uint8."""
    n, k = q.shape
    groups = k // SUPER
    q = q.to(torch.uint8).reshape(n, groups, 2, 4, 32)  # half, f, l: input 128h + 32f + l
    ql = torch.cat([q[:, :, :, 0] & 15 | (q[:, :, :, 2] & 15) << 4, q[:, :, :, 1] & 15 | (q[:, :, :, 3] & 15) << 4],
                   3).reshape(n, groups, 128)
    qh = ((q >> 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)).sum(3, dtype=torch.uint8)
    scales = sc.to(torch.int8).reshape(n, groups, 16).view(torch.uint8)
    head = d.half().contiguous().view(torch.uint8).reshape(n, groups, 2)
    return torch.cat([ql, qh.reshape(n, groups, 64), scales, head], 2).reshape(n, -1)


def dequantize(kind: str, raw) -> torch.Tensor:
    """The weight the bytes stand for, exactly, in float64 (n, k)."""
    if kind == "q4_k":
        q, sc, mn, d, dmin = decode_q4k(raw)
        step = (d.double().repeat_interleave(8, 1) * sc.double()).repeat_interleave(32, 1)
        low = (dmin.double().repeat_interleave(8, 1) * mn.double()).repeat_interleave(32, 1)
        return step * q.double() - low
    q, sc, d = decode_q6k(raw)
    step = (d.double().repeat_interleave(16, 1) * sc.double()).repeat_interleave(16, 1)
    return step * (q.double() - 32)


def random_blocks(kind: str, n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Raw bytes of random valid blocks: random codes and scales (every value the format allows), d and dmin fp16
    in 1e-3 .. 1e-2."""
    def codes(high, *shape, dtype=torch.uint8):
        return torch.randint(0, high, shape, generator=generator).to(dtype)

    def scale(groups):
        return (10 ** (-3 + torch.rand(n, groups, generator=generator, dtype=torch.float64))).half()

    groups = k // SUPER
    if kind == "q4_k":
        return encode_q4k(codes(16, n, k), codes(64, n, k // 32), codes(64, n, k // 32), scale(groups), scale(groups))
    sc = (torch.randint(-128, 128, (n, k // 16), generator=generator)).to(torch.int8)
    return encode_q6k(codes(64, n, k), sc, scale(groups))


def pack(kind: str, raw) -> torch.Tensor:
    """GGUF bytes in the kernel's layout (kquant_rows.cpp): (ceil(n / 16), k / 256, 2368 or 3360) uint8, channels
    past n all zero. The code bytes are the file's own (Q4_K qs, Q6_K ql and qh), only reordered: 4 inputs of each
    of the 16 channels side by side."""
    blocks = _blocks(raw, kind)
    n, groups = blocks.shape[:2]
    count = -(-n // LANES)
    blocks = torch.cat([blocks, blocks.new_zeros(count * LANES - n, groups, BLOCK_BYTES[kind])])

    def lanes(part: torch.Tensor, width: int = 4) -> torch.Tensor:  # [b, lane, t, r, e] -> [b, t, r, lane, e]
        per = part.reshape(count, LANES, groups, -1, width).permute(0, 2, 3, 1, 4)
        return per.reshape(count, groups, -1)

    if kind == "q4_k":
        _, sc, mn, _, _ = decode_q4k(blocks.reshape(count * LANES, -1))
        scales = lanes(sc, 1)  # byte 16s + lane
        mins = lanes(mn, 2)  # byte 32p + 2 lane + e: mn of sub-block 2p + e
        parts = [lanes(blocks[..., 16:]), scales, mins, lanes(blocks[..., 0:2], 2), lanes(blocks[..., 2:4], 2)]
    else:
        parts = [lanes(blocks[..., :128]), lanes(blocks[..., 128:192]), lanes(blocks[..., 192:208], 1),
                 lanes(blocks[..., 208:210], 2)]
    return torch.cat(parts, 2).contiguous()


@functools.cache
def _extension(isa: str):
    return load_extension(f"eagle_fsd_kquant_rows_{isa}", Path(__file__).with_name("kquant_rows.cpp"),
                          ["-O3", "-fopenmp", *ISA_FLAGS[isa][1]], ["-fopenmp"])


@functools.cache
def kquant_rows_isa() -> str | None:
    """The build this machine runs, chosen as int4_rows_isa chooses (the best one the CPU and torch's capability
    allow), if it compiles here; else None."""
    return building_isa(cpu_flags(), _extension)


def kquant_rows_available() -> bool:
    """This CPU runs one of the builds (AVX-512 VNNI or AVX2) and it compiles here."""
    return kquant_rows_isa() is not None


def _isa() -> str:
    isa = kquant_rows_isa()
    if isa is None:
        raise RuntimeError("the Q4_K / Q6_K kernel needs a CPU with AVX-512 VNNI or AVX2 and a C++ compiler with ninja")
    return isa


def _kind(kind: str) -> int:
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {KINDS}")
    return _KIND_ID[kind]


def kquant_rows_linear(x: torch.Tensor, packed: torch.Tensor, kind: str, out_features: int,
                       bias: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """x (..., k) fp32 -> (..., out_features) fp32 through the packed weight, on the build `isa` (None: the one
    `kquant_rows_isa` picks)."""
    rows = x.reshape(-1, x.shape[-1])
    width = packed.shape[0] * LANES
    if bias is not None and bias.numel() != width:
        bias = torch.cat([bias.float(), bias.new_zeros(width - bias.numel(), dtype=torch.float32)])
    bias = torch.empty(0) if bias is None else bias.float()
    y = _extension(isa or _isa()).kquant_rows_linear(rows.float(), packed, _kind(kind), bias)
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    return y.reshape(*x.shape[:-1], out_features)


def kquant_rows_entry(kind: str, isa: str | None = None) -> int:
    """The address of the build's C entry for `kind` (q4k_rows_into or q6k_rows_into), which
    eagle_fsd.kernels.decoder_glue's layer loop calls."""
    return _extension(isa or _isa()).entry(_kind(kind))


def kquant_rows_reference(x: torch.Tensor, kind: str, raw, bias=None) -> torch.Tensor:
    """The kernel's product in float64: a_i sum_j W_oj v_ij (+ bias), W the exact dequantized weight."""
    v, a = round_rows(x.reshape(-1, x.shape[-1]))
    y = (v.double() @ dequantize(kind, raw).T) * a.double()
    return y if bias is None else y + bias.double()
