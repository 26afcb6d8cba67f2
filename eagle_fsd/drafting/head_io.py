"""Draft heads as modules and files: what EAGLE-1/2 and EAGLE-3 heads share (HeadModule), and reading a head's
config.json and weights (model.safetensors or pytorch_model.bin) from a local directory or a hub repository (the cache
first, so that offline use works) into a module exactly."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig


class HeadModule(nn.Module):
    """A draft head's module: built for one target, whose dtype it is cast to."""

    def cast(self, dtype: torch.dtype) -> HeadModule:
        """The weights in `dtype`; buffers stay as they are: the rotary frequencies fp32 as the target's (a bf16
        inv_freq would let the draft's RoPE angles drift away from the target's as positions grow), id maps integer."""
        for param in self.parameters():
            param.data = param.data.to(dtype)
        return self


def head_file(path: str, name: str) -> str | None:
    """Path of one head file in a local dir, or from the hub (cache first, so that offline use works)."""
    if os.path.isdir(path):
        local = os.path.join(path, name)
        return local if os.path.isfile(local) else None
    if path.startswith(("/", ".", "~")) or os.sep + os.sep in path:
        raise FileNotFoundError(f"EAGLE head directory {path!r} does not exist")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(path, name)
    except EntryNotFoundError:
        return None
    except Exception as err:
        raise FileNotFoundError(f"EAGLE head {path!r} is neither a local directory nor a reachable hub repo "
                                f"({type(err).__name__}); pass a directory holding config.json and "
                                "model.safetensors or pytorch_model.bin") from err


def read_head_config(path: str) -> dict:
    """config.json of an EAGLE head (local dir or hub id)."""
    config_file = head_file(path, "config.json")
    if config_file is None:
        raise FileNotFoundError(f"EAGLE head {path!r} has no config.json")
    with open(config_file) as f:
        return json.load(f)


def read_head_files(path: str):
    """config dict and state dict of a published EAGLE head (local dir or hub id)."""
    config = read_head_config(path)
    if (weights := head_file(path, "model.safetensors")) is not None:
        return config, load_file(weights)
    if (weights := head_file(path, "pytorch_model.bin")) is not None:
        return config, torch.load(weights, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"EAGLE head {path!r} has neither model.safetensors nor pytorch_model.bin")


def head_config(raw: dict) -> tuple[LlamaConfig, bool, bool]:
    keys = {k: v for k, v in raw.items() if k not in ("bias", "qkv_bias", "architectures")}
    config = LlamaConfig(**keys)
    config.num_hidden_layers = 1
    return config, bool(raw.get("bias", True)), bool(raw.get("qkv_bias", False))


def load_weights(head: nn.Module, state: dict, what: str, layout: str) -> None:
    """Load `state` into `head` exactly; ValueError naming `what` and `layout` for misshapen, missing or unexpected
    weights."""
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as err:  # wrong tensor shapes
        raise ValueError(f"{what} does not fit the {layout} layout for this config: {err}") from err
    if missing or unexpected:
        raise ValueError(f"{what} does not match the {layout} layout: missing {missing}, unexpected {unexpected}")


def holds_eagle_fc(path: str) -> bool:
    """A local directory whose weights hold EAGLE's `fc` layer (the feature/embedding fusion no causal LM has)."""
    folder = Path(path)
    if (folder / "model.safetensors").is_file():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            return "fc.weight" in f.keys()
    if (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=True)
        return "fc.weight" in state
    return False
