"""4-bit weights times 8-bit activations rounded per row, on CPUs with AVX-512 VNNI or with AVX2 (int4_rows.cpp has
the math; both builds give the same bits).

A C++ extension built on first use by torch.utils.cpp_extension (a C++ compiler and ninja; about a minute, cached
as cpp_build says). `int4_rows_isa()` names the build this machine runs (None: none), capped like PyTorch's
own kernels by ATEN_CPU_CAPABILITY (`ATEN_CPU_CAPABILITY=avx2` measures an AVX2-only CPU on a newer one);
`int4_rows_reference` is the same product in float64 from the dequantized weights, for tests.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from .cpp_build import load_extension

LANES, GROUP, LEVELS = 16, 32, 15  # channels per block, inputs per scale, largest 4-bit code
ISA_FLAGS = {  # the builds, best first: the CPU flags each needs and the compiler flags it is built with
    "avx512_vnni": (("avx512f", "avx512bw", "avx512_vnni", "fma", "f16c"),
                    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c")),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
}
CAPABILITY_ISAS = {"DEFAULT": (), "AVX2": ("avx2",)}  # torch's capability -> the builds it allows (else all)


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def _extension(isa: str):
    # -fopenmp: at::parallel_for is OpenMP in a header, serial without it (torch's own libgomp is the one loaded)
    return load_extension(f"eagle_fsd_int4_rows_{isa}", Path(__file__).with_name("int4_rows.cpp"),
                          ["-O3", "-fopenmp", *ISA_FLAGS[isa][1]], ["-fopenmp"])


def runnable_isas(flags: set[str], capability: str) -> list[str]:
    """The builds this CPU can run, best first, within torch's CPU capability (ATEN_CPU_CAPABILITY caps both)."""
    allowed = CAPABILITY_ISAS.get(capability.upper(), tuple(ISA_FLAGS))
    return [isa for isa, (needs, _) in ISA_FLAGS.items() if isa in allowed and set(needs) <= flags]


def building_isa(flags: set[str], build) -> str | None:
    """The best build CPU `flags` and torch's capability allow (`runnable_isas`), if `build(isa)` compiles here (a
    kernel's extension loader); else None."""
    isas = runnable_isas(flags, torch.backends.cpu.get_cpu_capability())
    if not isas:
        return None
    try:
        build(isas[0])
    except Exception:  # no compiler, no ninja, headers missing: the caller's fallback stays
        return None
    return isas[0]


@functools.cache
def int4_rows_isa() -> str | None:
    """The build this machine runs: the best one its CPU allows, if it compiles here; else None (the int8 path)."""
    return building_isa(cpu_flags(), _extension)


def int4_rows_available() -> bool:
    """This CPU runs one of the builds (AVX-512 VNNI or AVX2) and it compiles here."""
    return int4_rows_isa() is not None


def fits_int4(weight: torch.Tensor) -> bool:
    """Every group of 32 inputs of every row takes at most 16 distinct values: the weight is 4-bit already (a GGUF's
    Q4 blocks, dequantized), so rounding it to 4 bits again moves each value by float rounding at most."""
    out_features, in_features = weight.shape
    if in_features % GROUP:
        return False
    groups = weight.detach().reshape(-1, GROUP)
    return _at_most_16_values(groups[:4096]) and _at_most_16_values(groups)  # a 6- or 8-bit weight fails early


def _at_most_16_values(groups: torch.Tensor) -> bool:
    ordered = groups.float().sort(dim=1).values
    distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(1)
    return bool((distinct <= LEVELS + 1).all())


def quantize_int4(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W (n, k) -> codes q (n, k) uint8 in 0..15, scales s and minima m (n, k / group) fp16 with W ~ s q + m per group
    of `group` inputs (32, or a multiple of 32: fewer bytes, coarser): m the group's minimum, s its range / 15."""
    n, k = weight.shape
    if group % GROUP or k % group:
        raise ValueError(f"int4 group {group} must be a multiple of {GROUP} dividing the {k} inputs")
    w = weight.detach().float().reshape(n, k // group, group)
    low, high = w.amin(2), w.amax(2)
    m = low.half()
    s = ((high - low) / LEVELS).half().float().clamp(min=2.0 ** -24).half()
    q = ((w - m.float().unsqueeze(2)) / s.float().unsqueeze(2)).round().clamp(0, LEVELS).to(torch.uint8)
    return q.reshape(n, k), s, m


def dequantize_int4(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """s q + m in float64, (n, k), per group of k / s.shape[1] inputs."""
    n, k = q.shape
    groups = s.shape[1]
    w = q.double().reshape(n, groups, k // groups) * s.double().unsqueeze(2) + m.double().unsqueeze(2)
    return w.reshape(n, k)


def pack_int4(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Codes and scales in the kernel's layout (int4_rows.cpp): (ceil(n / 16), groups, 8 group + 64) uint8 for groups
    of group = k / s.shape[1] inputs (320 bytes at 32); channels past n are zero."""
    n, k = q.shape
    blocks, groups = -(-n // LANES), s.shape[1]
    parts = k // groups // GROUP
    pad = blocks * LANES - n
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        s, m = torch.cat([s, s.new_zeros(pad, groups)]), torch.cat([m, m.new_zeros(pad, groups)])
    # q[b, lane, g, part, chunk, t] -> [b, g, part, chunk, lane, t]: byte 4 lane + t of a part's chunk c = input
    # 4 c + t of that part of that lane
    chunks = q.reshape(blocks, LANES, groups, parts, 8, 4).permute(0, 2, 3, 4, 1, 5)
    codes = (chunks[:, :, :, :4] | (chunks[:, :, :, 4:] << 4)).reshape(blocks, groups, 256 * parts)
    scales = torch.stack([s.reshape(blocks, LANES, groups), m.reshape(blocks, LANES, groups)], 1)  # b, s|m, lane, g
    scales = scales.permute(0, 3, 1, 2).contiguous().view(torch.uint8).reshape(blocks, groups, 64)
    return torch.cat([codes, scales], 2).contiguous()


def round_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, k) -> (v, a): v = round(x / a) in -127..127, a = max |x| / 127 per row (the kernel's rounding)."""
    x = x.float()
    peak = x.abs().amax(1, keepdim=True).clamp(min=1e-30)
    return torch.round(x * (127.0 / peak)), peak / 127.0


def int4_rows_reference(x: torch.Tensor, q, s, m, bias=None) -> torch.Tensor:
    """The kernel's product in float64: a_i sum_j (s q + m)_oj v_ij (+ bias)."""
    v, a = round_rows(x.reshape(-1, x.shape[-1]))
    y = (v.double() @ dequantize_int4(q, s, m).T) * a.double()
    return y if bias is None else y + bias.double()


def int4_rows_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                     bias: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """x (..., k) fp32 -> (..., out_features) fp32 through the packed 4-bit weight, on the build `isa` (None: the
    one `int4_rows_isa` picks)."""
    rows = x.reshape(-1, x.shape[-1])
    if bias is not None and bias.numel() != packed.shape[0] * LANES:
        bias = torch.cat([bias.float(), bias.new_zeros(packed.shape[0] * LANES - bias.numel(), dtype=torch.float32)])
    bias = torch.empty(0) if bias is None else bias.float()
    y = _extension(isa or _isa()).int4_rows_linear(rows.float(), packed, bias)
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    return y.reshape(*x.shape[:-1], out_features)


def int4_rows_entry(isa: str | None = None) -> int:
    """The address of the build's C entry (int4_rows_into), which eagle_fsd.kernels.decoder_glue's layer loop calls."""
    return _extension(isa or _isa()).entry()


def _isa() -> str:
    isa = int4_rows_isa()
    if isa is None:
        raise RuntimeError("the int4 kernel needs a CPU with AVX-512 VNNI or AVX2 and a C++ compiler with ninja; "
                           "use target_quant 'int8' or 'off'")
    return isa
