"""The EAGLE-1/2 head as `train-head` makes and saves it: the published layout (eagle-llm's cnets.Model keys without
embed_tokens; a Llama config with num_hidden_layers 1 plus "bias"), loadable by `eagle_fsd.drafting.load_eagle_head`."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from eagle_fsd.drafting import EagleHead, head_config
from eagle_fsd.dtypes import dtype_name
from eagle_fsd.files import atomic_write_text, sha256_file

# config keys a head copies from its target (the rest of a target's config is irrelevant to one Llama layer)
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "initializer_range",
               "bos_token_id", "eos_token_id", "pad_token_id")
HEAD_FILES = ("config.json", "model.safetensors")


def head_raw_config(target_config, bias: bool = True) -> dict:
    """The published EAGLE-1/2 config of a head for this target: a Llama config with num_hidden_layers 1 (+ "bias";
    + "qkv_bias" for Qwen2-style targets, whose attention has q/k/v biases)."""
    src = target_config.to_dict()
    raw = {k: src[k] for k in CONFIG_KEYS if src.get(k) is not None}
    rope = src.get("rope_parameters") or {}
    theta = rope.get("rope_theta", src.get("rope_theta"))
    if theta is not None:
        raw["rope_theta"] = theta
    if rope and rope.get("rope_type", "default") != "default":
        raw["rope_parameters"] = rope
    raw.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, bias=bias,
               attention_bias=False, mlp_bias=False, tie_word_embeddings=False, torch_dtype="float16")
    if str(src.get("model_type", "")).startswith("qwen2"):
        raw["qkv_bias"] = True
    return raw


def new_head(raw: dict, seed: int = 0) -> EagleHead:
    config, bias, qkv_bias = head_config(raw)
    config._attn_implementation = "sdpa"  # training: causal SDPA without an explicit mask
    torch.manual_seed(seed)
    return EagleHead(config, bias=bias, qkv_bias=qkv_bias)


def head_state(head: EagleHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The published layout: fc.*, layers.0.* (no input_layernorm, no rotary buffers, no embedding)."""
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()
            if not k.startswith("rotary_emb")}


def save_head(head: EagleHead, raw: dict, out_dir: Path, dtype: torch.dtype = torch.float16) -> str:
    """config.json + model.safetensors; returns the weights' sha256."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    raw = dict(raw, torch_dtype=dtype_name(dtype))
    tmp = out_dir / "model.safetensors.tmp"
    save_file(head_state(head, dtype), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out_dir / "model.safetensors")
    atomic_write_text(out_dir / "config.json", json.dumps(raw, indent=2) + "\n")
    return sha256_file(out_dir / "model.safetensors")
