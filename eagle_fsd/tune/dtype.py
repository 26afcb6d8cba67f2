"""dtype "auto": bf16 on CUDA; on CPU bf16 only where it is native and measures faster on the model's own shape."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from eagle_fsd.tune.measure import timed_rounds


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(flags: set[str] | None = None) -> bool:
    """bf16 matmul in hardware: AMX-BF16 or AVX-512 BF16 (without them bf16 GEMMs are emulated and their cost
    grows linearly with rows)."""
    flags = cpu_flags() if flags is None else flags
    return bool({"amx_bf16", "avx512_bf16"} & flags)


@functools.lru_cache(maxsize=None)
def bf16_measures_faster(hidden: int = 1536, intermediate: int = 8960) -> bool:
    """The model's MLP up-projection (hidden -> intermediate) over 1, 4 and 8 rows (plain steps and small trees),
    bf16 against fp32 on this CPU, timed round-robin: bf16 when the three together take less time."""
    w32 = torch.randn(intermediate, hidden)
    w16 = w32.bfloat16()
    inputs = {rows: torch.randn(rows, hidden) for rows in (1, 4, 8)}
    fns = {}
    for rows, x32 in inputs.items():
        x16 = x32.bfloat16()
        fns[("bf16", rows)] = lambda x=x16: torch.nn.functional.linear(x, w16)
        fns[("fp32", rows)] = lambda x=x32: torch.nn.functional.linear(x, w32)
    timed = timed_rounds(fns, rounds=9)
    total = {dt: sum(t for (name, _), t in timed.items() if name == dt) for dt in ("bf16", "fp32")}
    return total["bf16"] < total["fp32"]


def resolve_dtype(dtype, device_map=None, config=None):
    """dtype "auto": CUDA -> bf16 (fp16 without bf16 support); CPU -> bf16 only with native bf16 matmul that
    also measures faster on the model's own MLP shape (`config`; 1, 4 and 8 rows together), else fp32. Anything
    else is returned unchanged."""
    if dtype != "auto":
        return dtype
    on_cuda = torch.cuda.is_available() and device_map is not None and "cpu" not in str(device_map)
    if on_cuda:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if not native_bf16():
        return torch.float32
    shape = () if config is None else (config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size))
    return torch.bfloat16 if bf16_measures_faster(*shape) else torch.float32
