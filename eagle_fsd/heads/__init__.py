"""EAGLE-1/2 heads shipped inside the package, one folder per target preset (config.json + model.safetensors, in the
published EAGLE-1/2 layout; load with `eagle_fsd.drafters.load_eagle_head(str(head_dir(name)), target)`).
How each was trained (command, data, wall time, held-out top-1, tau) is recorded in BENCHMARKS.md."""
from __future__ import annotations

import hashlib
from pathlib import Path

HEADS = {
    # trained with `eagle-fsd train-head` on SmolLM2's own greedy replies to ShareGPT prompts (self-distillation)
    "smollm2-135m-instruct": {"sha256": "PLACEHOLDER", "dtype": "float16"},
}


def head_dir(name: str) -> Path:
    """The folder of the head shipped for preset `name`."""
    if name not in HEADS:
        raise KeyError(f"no EAGLE head is shipped for {name!r}; shipped: {sorted(HEADS)}")
    folder = Path(__file__).resolve().parent / name
    if not (folder / "model.safetensors").is_file() or not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the shipped head {folder} is incomplete (config.json + model.safetensors); "
                                "reinstall eagle-fsd")
    return folder


def verify(name: str) -> Path:
    """head_dir(name), after checking the weights' sha256 against the recorded one."""
    folder = head_dir(name)
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    if digest != HEADS[name]["sha256"]:
        raise ValueError(f"{folder / 'model.safetensors'} has sha256 {digest}, expected {HEADS[name]['sha256']}: "
                         "the file is damaged; reinstall eagle-fsd")
    return folder
