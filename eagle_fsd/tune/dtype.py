"""dtype "auto": bf16 on CUDA; on CPU bf16 only where it is native and measures faster on the model's own shape.
prepack "auto": oneDNN-packed linear weights (fp32, or bf16 where oneDNN supports it) where they measure faster.
draft_quant "auto": an LM drafter on CPU drafts with int4 weights where that kernel measures faster (eagle_fsd.quant).
target_quant "auto": a preset's target (a GGUF model, already rounded) runs int8 x int8, or int4 x int8 where its
weights are 4-bit, on CPU where that measures faster (eagle_fsd.target_quant)."""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from pathlib import Path

import torch

from eagle_fsd.files import atomic_write_text, cache_dir
from eagle_fsd.kernels.int4_rows import int4_rows_available, int4_rows_isa
from eagle_fsd.kernels.int8_rows import int8_rows_builds
from eagle_fsd.prepack import pack_weight, packed_linear, prepack_supported
from eagle_fsd.quant import QuantLinear, quant_supported
from eagle_fsd.target_quant import Int4Product, RowQuantLinear, row_int8_supported
from eagle_fsd.tune.measure import device_name, timed_rounds
from eagle_fsd.tune.trust import CPU_CAP_VARS, TimingWatch


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_class(cpuinfo: str | None = None) -> str:
    """The CPU as a figure must name it: 'family F model M' and its widest matrix instructions (a KVM guest's model
    name alone, 'AMD EPYC', hides both), from /proc/cpuinfo's text (`cpuinfo`: that text, else read here); '' where
    it says neither."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = set(fields.get("flags", "").split())
    isa = next((name for name, flag in (("amx", "amx_tile"), ("avx512_vnni", "avx512_vnni"), ("avx512", "avx512f"),
                                        ("avx2", "avx2")) if flag in flags), "")
    if "cpu family" not in fields:
        return isa
    return f"family {fields['cpu family']} model {fields.get('model', '?')}" + (f", {isa}" if isa else "")


def native_bf16(flags: set[str] | None = None) -> bool:
    """bf16 matmul in hardware: AMX-BF16 or AVX-512 BF16 (without them bf16 GEMMs are emulated and their cost
    grows linearly with rows)."""
    flags = cpu_flags() if flags is None else flags
    return bool({"amx_bf16", "avx512_bf16"} & flags)


def mlp_kernel_ms(hidden: int, intermediate: int, kinds: tuple[str, ...], rows=(1, 4, 8),
                  watch: TimingWatch | None = None) -> dict[str, float]:
    """Time of the MLP up-projection (hidden -> intermediate) over `rows` rows together (plain steps and small
    trees) for each kind of kernel ("fp32", "bf16", "fp32-packed", "bf16-packed"; "int4" / "int4-fp32": int4 weights
    with bf16 / fp32 activations; "int8-rows" / "int4-rows": eagle_fsd.target_quant), timed round-robin. The weights rotate over copies totalling 128 MB in fp32, so
    they come from memory, as in a decode step, not from cache."""
    copies = max(1, math.ceil(128 * 2**20 / (hidden * intermediate * 4)))
    weights32 = [torch.randn(intermediate, hidden) for _ in range(copies)]
    weights = {"fp32": weights32}
    if "bf16" in kinds or "bf16-packed" in kinds:
        weights["bf16"] = [w.bfloat16() for w in weights32]
    if "bf16-packed" in kinds:
        weights["bf16-packed"] = [pack_weight(w) for w in weights["bf16"]]
    if "fp32-packed" in kinds:
        weights["fp32-packed"] = [pack_weight(w) for w in weights32]
    if "int4" in kinds:
        weights["int4"] = [QuantLinear.from_weight(w.bfloat16(), None, 4) for w in weights32]
    if "int4-fp32" in kinds:
        weights["int4-fp32"] = [QuantLinear.from_weight(w, None, 4) for w in weights32]
    if "int8-rows" in kinds:
        weights["int8-rows"] = [RowQuantLinear.from_linear(torch.nn.Linear(hidden, intermediate, bias=False))
                                for _ in weights32]
    if "int4-rows" in kinds:  # 4-bit weights: the kernel packs what it is given, rounded to 4 bits
        weights["int4-rows"] = [Int4Product(torch.randn(intermediate, hidden), None) for _ in weights32]
    kernels = {"fp32": torch.nn.functional.linear, "bf16": torch.nn.functional.linear,
               "bf16-packed": lambda x, w: packed_linear(x, w, None),
               "fp32-packed": lambda x, w: packed_linear(x, w, None), "int4": lambda x, layer: layer(x),
               "int4-fp32": lambda x, layer: layer(x), "int8-rows": lambda x, layer: layer(x),
               "int4-rows": lambda x, product: product(x)}
    fns = {}
    for n in rows:
        x32 = torch.randn(n, hidden)
        inputs = {"fp32": x32, "bf16": x32.bfloat16(), "bf16-packed": x32.bfloat16(), "fp32-packed": x32,
                  "int4": x32.bfloat16(), "int4-fp32": x32, "int8-rows": x32, "int4-rows": x32}
        for kind in kinds:
            fns[(kind, n)] = lambda f=kernels[kind], x=inputs[kind], ws=weights[kind]: [f(x, w) for w in ws]
    timed = timed_rounds(fns, rounds=9, watch=watch)
    return {kind: sum(t for (name, _), t in timed.items() if name == kind) for kind in kinds}


RACE_VERSION = 1  # bump when mlp_kernel_ms times another thing


def race_path() -> Path:
    return cache_dir() / "tune" / "kernel_races.json"


def raced_ms(hidden: int, intermediate: int, kinds: tuple[str, ...], rows=(1, 4, 8)) -> dict[str, float]:
    """`mlp_kernel_ms`, timed once per machine (CPU, its flags and instruction-set caps, threads, torch, our kernel
    builds) and kept in `race_path()` when the machine was quiet (eagle_fsd.tune.trust); `eagle-fsd tune --force`
    times again."""
    ours = {"int4-rows", "int8-rows"} & set(kinds)  # our kernels' builds count only where they race
    key = json.dumps({"cpu": device_name(torch.device("cpu")), "flags": sorted(cpu_flags()),
                      "caps": {name: os.environ[name] for name in CPU_CAP_VARS if name in os.environ},
                      "threads": torch.get_num_threads(), "torch": torch.__version__.split("+")[0],
                      "builds": [int4_rows_isa(), *int8_rows_builds()] if ours else None,
                      "version": RACE_VERSION,
                      "shape": [hidden, intermediate], "kinds": list(kinds), "rows": list(rows)}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    races = read_races()
    if digest in races:
        return races[digest]
    watch = TimingWatch(torch.get_num_threads())
    ms = mlp_kernel_ms(hidden, intermediate, kinds, rows, watch=watch)
    if watch.busy_reason() is None:
        races = read_races()  # another process may have added its own since
        races[digest] = ms
        race_path().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(race_path(), json.dumps(races, indent=1, sort_keys=True))
    return ms


def read_races() -> dict[str, dict[str, float]]:
    """{key digest: ms by kernel kind} of the kernel races kept on this machine ({} if none or unreadable)."""
    try:
        races = json.loads(race_path().read_text())
    except (OSError, ValueError):
        return {}
    return races if isinstance(races, dict) else {}


def forget_races() -> None:
    """Drops the kept kernel races (`eagle-fsd tune --force`): the next load times them again."""
    race_path().unlink(missing_ok=True)
    fastest_kind.cache_clear(), int4_measures_faster.cache_clear(), fastest_target_bits.cache_clear()


@functools.lru_cache(maxsize=None)
def fastest_kind(hidden: int, intermediate: int, kinds: tuple[str, ...]) -> str:
    """The kernel kind of `kinds` that takes least time on the model's MLP shape (`mlp_kernel_ms`)."""
    ms = raced_ms(hidden, intermediate, kinds)
    return min(kinds, key=ms.__getitem__)


def mlp_shape(config) -> tuple[int, int]:
    """(hidden, intermediate) of a model config, the shape the kernels are timed on."""
    if config is None:
        return 1536, 8960
    return config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size)


def candidate_kinds(dtype: torch.dtype, prepack) -> tuple[str, ...]:
    """The kernel kinds a CPU model in `dtype` may run under `prepack`: plain, packed (on), or either (auto)."""
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    choice = prepack_choice(prepack)
    if choice == "off" or not prepack_supported(dtype, "cpu"):
        return (name,)
    return (f"{name}-packed",) if choice == "on" else (name, f"{name}-packed")


def resolve_dtype(dtype, device_map=None, config=None, prepack="auto"):
    """dtype "auto": CUDA -> bf16 (fp16 without bf16 support); CPU -> bf16 only with native bf16 matmul that
    also measures faster on the model's own MLP shape (`config`; 1, 4 and 8 rows together), else fp32. Both are timed
    as they may run: plain, and prepacked for oneDNN unless `prepack` is off or unsupported. Anything else is
    returned unchanged."""
    if dtype != "auto":
        return dtype
    if load_device(device_map).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if not native_bf16():
        return torch.float32
    kinds = candidate_kinds(torch.float32, prepack) + candidate_kinds(torch.bfloat16, prepack)
    return torch.bfloat16 if fastest_kind(*mlp_shape(config), kinds).startswith("bf16") else torch.float32


def prepack_choice(prepack) -> str:
    """"auto", "on" or "off" from the accepted spellings (True / False too); anything else is an error."""
    choice = ("on" if prepack else "off") if isinstance(prepack, bool) else prepack
    if choice not in ("on", "off", "auto"):
        raise ValueError(f"prepack={prepack!r}: use 'auto', 'on' or 'off' (or True / False)")
    return choice


def resolve_prepack(prepack, model) -> bool:
    """prepack True / "on", False / "off" or "auto" for a loaded model: "auto" packs where oneDNN supports it (CPU,
    fp32, or bf16 with oneDNN bf16) and the packed kernel measures faster on the model's MLP shape; forcing it where
    unsupported is an error."""
    choice = prepack_choice(prepack)
    if choice == "off":
        return False
    supported = prepack_supported(model.dtype, model.device)
    if choice == "on" and not supported:
        raise ValueError(f"prepack on needs a CPU model in fp32, or in bf16 with oneDNN bf16 support (AVX-512 BF16 or "
                         f"AMX); this model is {model.dtype} on {model.device}. Use prepack 'auto' or 'off'")
    if choice == "on" or not supported:
        return supported
    kinds = candidate_kinds(model.dtype, "auto")
    return fastest_kind(*mlp_shape(model.config), kinds).endswith("-packed")


DRAFT_QUANT = {"off": 0, "int4": 4, "int8": 8}


def resolve_draft_quant(draft_quant, drafter, prepacked: bool = False) -> int:
    """Bits of the drafter's weights (0: as loaded) for draft_quant "auto", "int4", "int8" or "off". "auto": int4
    for an LM drafter on the CPU where the kernel exists and measures faster than the drafter's own kernel on its MLP
    shape (`prepacked`: its weights are packed for oneDNN); EAGLE heads stay as they are (small, and their lm_head is
    the target's)."""
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
    if not drafter.auto_quant or not quant_supported(4, device):
        return 0
    return 4 if int4_measures_faster(*mlp_shape(module.config), kernel_kind(module, prepacked)) else 0


def kernel_kind(module, prepacked: bool) -> str:
    """The kernel kind (`mlp_kernel_ms`) the module's linear layers run (prepacked or not)."""
    name = "bf16" if next(module.parameters()).dtype == torch.bfloat16 else "fp32"
    return f"{name}-packed" if prepacked else name


@functools.lru_cache(maxsize=None)
def int4_measures_faster(hidden: int, intermediate: int, current: str) -> bool:
    """int4 weights against the `current` kernel kind on the drafter's MLP shape (`mlp_kernel_ms`), activations
    in the drafter's dtype, over the few rows that int4 serves (eagle_fsd.quant.MAX_QUANT_ROWS)."""
    int4 = "int4-fp32" if current.startswith("fp32") else "int4"
    ms = raced_ms(hidden, intermediate, (current, int4), rows=(1, 2, 4))  # a draft level's nodes
    return ms[int4] < ms[current]


TARGET_QUANT = ("auto", "int4", "int8", "off")


def target_quant_choice(target_quant) -> str:
    """target_quant checked: "auto", "int4", "int8" or "off"; anything else is an error."""
    if target_quant not in TARGET_QUANT:
        raise ValueError(f"target_quant={target_quant!r}: use 'auto', 'int4', 'int8' or 'off'")
    return target_quant


def load_device(device_map) -> torch.device:
    """The device a model loaded with `device_map` lands on: CUDA where named (or "auto" with a GPU), else the CPU."""
    on_cuda = torch.cuda.is_available() and device_map is not None and "cpu" not in str(device_map)
    return torch.device("cuda" if on_cuda else "cpu")


def resolve_target_quant(target_quant, config, dtype: torch.dtype, device: torch.device, preset: bool,
                         dtype_given: bool, prepack="auto") -> int:
    """Bits of the target's quantized linear layers (eagle_fsd.target_quant), decided before it loads from its
    `config`, the `dtype` it would run in and its `device`: 0 (float weights), 8 (int8 x int8) or 4 (int4 x int8 for
    the weights that are 4-bit already, int8 x int8 for the rest). "auto": on a CPU with the kernels, for a preset
    target (its weights are a GGUF's, already rounded to 4-6 bits) loaded with dtype "auto", the kernel that measures
    fastest on its MLP shape over 1 to 16 rows (plain steps and trees) among the float kernels the target may run
    under `prepack`, int8 and int4; a model given by hub id or directory, or a dtype named, keeps its float weights.
    "int8" / "int4" force it."""
    if target_quant_choice(target_quant) == "off":
        return 0
    supported = row_int8_supported(device)
    if target_quant in ("int8", "int4"):
        if not supported:
            raise ValueError(f"target_quant {target_quant} needs a target on the CPU and PyTorch's FBGEMM int8 linear; "
                             f"this target is on {device} (PyTorch {torch.__version__}). Use 'auto' or 'off'")
        if target_quant == "int4" and not int4_rows_available():
            raise ValueError("target_quant int4 needs a CPU with AVX-512 VNNI or AVX2 (within ATEN_CPU_CAPABILITY) and a "
                             "C++ compiler with ninja to build eagle_fsd.kernels.int4_rows on first use; use 'int8' or "
                             "'auto'")
        return 4 if target_quant == "int4" else 8
    if not (supported and preset and not dtype_given):
        return 0
    return fastest_target_bits(*mlp_shape(config), candidate_kinds(dtype, prepack))


@functools.lru_cache(maxsize=None)
def fastest_target_bits(hidden: int, intermediate: int, kinds: tuple[str, ...]) -> int:
    """8 or 4 where int8 x int8 or int4 x int8 (eagle_fsd.target_quant) is the fastest kernel on the MLP shape
    against each float kernel kind of `kinds`, else 0."""
    quantized = ("int8-rows", "int4-rows") if int4_rows_available() else ("int8-rows",)
    ms = raced_ms(hidden, intermediate, (*kinds, *quantized), rows=(1, 4, 8, 16))
    return {"int8-rows": 8, "int4-rows": 4}.get(min(ms, key=ms.__getitem__), 0)
