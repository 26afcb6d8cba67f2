"""dtype "auto": bf16 on CUDA; on CPU bf16 only where it is native and measures faster on the model's own shape.
prepack "auto": oneDNN-packed bf16 linear weights on CPU where oneDNN supports them and they measure faster.
draft_quant "auto": an LM drafter on CPU drafts with int4 weights where that kernel measures faster (eagle_fsd.quant)."""
from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from eagle_fsd.prepack import pack_weight, packed_linear, prepack_supported
from eagle_fsd.quant import QuantLinear, quant_supported
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


def mlp_kernel_ms(hidden: int, intermediate: int, kinds: tuple[str, ...], rows=(1, 4, 8)) -> dict[str, float]:
    """Time of the MLP up-projection (hidden -> intermediate) over `rows` rows together (plain steps and small
    trees) for each kind of kernel ("fp32", "bf16", "bf16-packed"; "int4" / "int4-fp32": int4 weights with bf16 /
    fp32 activations), timed round-robin. The weights rotate over copies totalling 128 MB in fp32, so they come from
    memory, as in a decode step, not from cache."""
    copies = max(1, math.ceil(128 * 2**20 / (hidden * intermediate * 4)))
    weights32 = [torch.randn(intermediate, hidden) for _ in range(copies)]
    weights = {"fp32": weights32}
    if "bf16" in kinds or "bf16-packed" in kinds:
        weights["bf16"] = [w.bfloat16() for w in weights32]
    if "bf16-packed" in kinds:
        weights["bf16-packed"] = [pack_weight(w) for w in weights["bf16"]]
    if "int4" in kinds:
        weights["int4"] = [QuantLinear.from_weight(w.bfloat16(), None, 4) for w in weights32]
    if "int4-fp32" in kinds:
        weights["int4-fp32"] = [QuantLinear.from_weight(w, None, 4) for w in weights32]
    kernels = {"fp32": torch.nn.functional.linear, "bf16": torch.nn.functional.linear,
               "bf16-packed": lambda x, w: packed_linear(x, w, None), "int4": lambda x, layer: layer(x),
               "int4-fp32": lambda x, layer: layer(x)}
    fns = {}
    for n in rows:
        x32 = torch.randn(n, hidden)
        inputs = {"fp32": x32, "bf16": x32.bfloat16(), "bf16-packed": x32.bfloat16(), "int4": x32.bfloat16(),
                  "int4-fp32": x32}
        for kind in kinds:
            fns[(kind, n)] = lambda f=kernels[kind], x=inputs[kind], ws=weights[kind]: [f(x, w) for w in ws]
    timed = timed_rounds(fns, rounds=9)
    return {kind: sum(t for (name, _), t in timed.items() if name == kind) for kind in kinds}


@functools.lru_cache(maxsize=None)
def bf16_measures_faster(hidden: int = 1536, intermediate: int = 8960, packed: bool = False) -> bool:
    """bf16 against fp32 on the model's MLP shape (`mlp_kernel_ms`): bf16 when it takes less time. packed: bf16 as it
    will run, with the weights prepacked for oneDNN (eagle_fsd.prepack)."""
    bf16 = "bf16-packed" if packed else "bf16"
    ms = mlp_kernel_ms(hidden, intermediate, ("fp32", bf16))
    return ms[bf16] < ms["fp32"]


def resolve_dtype(dtype, device_map=None, config=None, prepack="auto"):
    """dtype "auto": CUDA -> bf16 (fp16 without bf16 support); CPU -> bf16 only with native bf16 matmul that
    also measures faster on the model's own MLP shape (`config`; 1, 4 and 8 rows together), else fp32. bf16 is timed
    as it will run: prepacked for oneDNN unless `prepack` is off or unsupported. Anything else is returned unchanged."""
    if dtype != "auto":
        return dtype
    on_cuda = torch.cuda.is_available() and device_map is not None and "cpu" not in str(device_map)
    if on_cuda:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if not native_bf16():
        return torch.float32
    shape = () if config is None else (config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size))
    packed = prepack_choice(prepack) != "off" and prepack_supported(torch.bfloat16, "cpu")
    return torch.bfloat16 if bf16_measures_faster(*shape, packed=packed) else torch.float32


@functools.lru_cache(maxsize=None)
def prepack_measures_faster(hidden: int = 1536, intermediate: int = 8960) -> bool:
    """bf16 with prepacked weights against `F.linear` in bf16 on the model's MLP shape (`mlp_kernel_ms`)."""
    ms = mlp_kernel_ms(hidden, intermediate, ("bf16", "bf16-packed"))
    return ms["bf16-packed"] < ms["bf16"]


def prepack_choice(prepack) -> str:
    """"auto", "on" or "off" from the accepted spellings (True / False too); anything else is an error."""
    choice = ("on" if prepack else "off") if isinstance(prepack, bool) else prepack
    if choice not in ("on", "off", "auto"):
        raise ValueError(f"prepack={prepack!r}: use 'auto', 'on' or 'off' (or True / False)")
    return choice


def resolve_prepack(prepack, model) -> bool:
    """prepack True / "on", False / "off" or "auto" for a loaded model: "auto" packs where oneDNN supports it (CPU,
    bf16) and the packed kernel measures faster on the model's MLP shape; forcing it where unsupported is an error."""
    choice = prepack_choice(prepack)
    if choice == "off":
        return False
    supported = prepack_supported(model.dtype, model.device)
    if choice == "on" and not supported:
        raise ValueError(f"prepack on needs a CPU model in bf16 and oneDNN bf16 support (AVX-512 BF16 or AMX); "
                         f"this model is {model.dtype} on {model.device}. Use prepack 'auto' or 'off'")
    if choice == "on" or not supported:
        return supported
    config = model.config
    return prepack_measures_faster(config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size))


DRAFT_QUANT = {"off": 0, "int4": 4, "int8": 8}


def resolve_draft_quant(draft_quant, drafter) -> int:
    """Bits of the drafter's weights (0: as loaded) for draft_quant "auto", "int4", "int8" or "off". "auto": int4
    for an LM drafter on the CPU where the kernel exists and measures faster than the drafter's own kernel on its MLP
    shape; EAGLE heads stay as they are (small, and their lm_head is the target's)."""
    if draft_quant != "auto" and draft_quant not in DRAFT_QUANT:
        raise ValueError(f"draft_quant={draft_quant!r}: use 'auto', 'int4', 'int8' or 'off'")
    if drafter is None or draft_quant == "off":
        return 0
    module = drafter.module
    device = next(module.parameters()).device
    if draft_quant != "auto":
        bits = DRAFT_QUANT[draft_quant]
        if not quant_supported(bits, device):
            raise ValueError(f"draft_quant {draft_quant} needs a drafter on the CPU and PyTorch's CPU int{bits} "
                             f"weight-only kernel; this drafter is on {device} (PyTorch {torch.__version__}). "
                             "Use draft_quant 'auto' or 'off'")
        return bits
    from eagle_fsd.drafters import LMDrafter

    if not isinstance(drafter, LMDrafter) or not quant_supported(4, device):
        return 0
    config = module.config
    return 4 if int4_measures_faster(config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size),
                                     bf16_kind(module)) else 0


def bf16_kind(module) -> str:
    """The kernel kind (`mlp_kernel_ms`) the module's linear layers run now."""
    from eagle_fsd.prepack import is_prepacked

    dtype = next(module.parameters()).dtype
    if dtype != torch.bfloat16:
        return "fp32"
    return "bf16-packed" if is_prepacked(module) else "bf16"


@functools.lru_cache(maxsize=None)
def int4_measures_faster(hidden: int, intermediate: int, current: str) -> bool:
    """int4 weights against the `current` kernel kind on the drafter's MLP shape (`mlp_kernel_ms`), activations
    in the drafter's dtype, over the few rows that int4 serves (eagle_fsd.quant.MAX_QUANT_ROWS)."""
    int4 = "int4-fp32" if current == "fp32" else "int4"
    ms = mlp_kernel_ms(hidden, intermediate, (current, int4), rows=(1, 2, 4))  # a draft level's nodes
    return ms[int4] < ms[current]
