"""Write an Eagle3Head as config.json + model.safetensors in one of the three published layouts.

  "eagle"        SafeAILab (yuhuili/EAGLE3-*): Llama config + draft_vocab_size; weights midlayer.*; reads the default
                 layers (2, N//2, N-3) only.
  "sglang"       SGLang / SpecForge: architectures LlamaForCausalLMEagle3, other layers in
                 eagle_config.eagle_aux_hidden_state_layer_ids (outputs of layers: index - 1, see
                 eagle_fsd.drafting.eagle3).
  "speculators"  vLLM speculators: architectures Eagle3Speculator, the Llama fields under transformer_layer_config,
                 weights layers.0.*, eagle_aux_hidden_state_layer_ids = inputs of layers (the indices themselves),
                 speculators_config.verifier.name_or_path = the target, which `vllm serve HEAD_DIR` loads.

A bias on fc: SGLang builds fc with `bias=config.bias`, and its Llama attention reads the same flag for o_proj, so
the sglang layout writes "bias": true and a zero o_proj bias (what this head computes). SafeAILab and vLLM (0.32
llama_eagle3.py) build fc without a bias: those layouts refuse such a head.
"""
from __future__ import annotations

import json
import os

import torch

from safetensors.torch import save_file

from eagle_fsd.drafting.eagle3 import LAYOUTS, SGLANG_ARCH, SPECULATORS_ARCH, Eagle3Head, default_aux_indices

_LLAMA_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "hidden_act", "max_position_embeddings", "rms_norm_eps", "attention_bias", "mlp_bias", "vocab_size",
                 "pad_token_id", "bos_token_id", "eos_token_id")


def llama_fields(head: Eagle3Head) -> dict:
    """The decoder layer's config as plain Llama fields, RoPE as rope_theta / rope_scaling (what every loader reads)."""
    config = head.config
    raw = config.to_dict()
    fields = {name: raw[name] for name in _LLAMA_FIELDS if raw.get(name) is not None}
    rope = dict(config.rope_parameters)
    fields["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.get("rope_type", "default")
    fields["rope_scaling"] = None if rope_type == "default" else {**rope, "type": rope_type}
    fields.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
                  torch_dtype=str(head.fc.weight.dtype).removeprefix("torch."))
    return fields


def _target_indices(head: Eagle3Head, target_config) -> tuple[int, ...] | None:
    """The head's output_hidden_states indices, None when they are the default ones (or unknown)."""
    indices = head.aux_hidden_indices
    if indices is not None and target_config is not None \
            and tuple(indices) == default_aux_indices(target_config.num_hidden_layers):
        return None
    return indices


def sglang_aux_ids(indices: tuple[int, ...]) -> list[int]:
    """Indices as SGLang reads them back (eagle_fsd.drafting.eagle3.aux_hidden_indices): outputs of layers
    (index - 1) when that list starts at 1, else the indices themselves (which must then not start at 1)."""
    if indices[0] == 2:
        return [i - 1 for i in indices]
    if indices[0] == 1:
        raise ValueError(f"hidden-state indices {indices} (input of layer 1 first) have no SGLang spelling: its rule "
                         "adds 1 to id lists that start at 1; use the speculators layout")
    return list(indices)


def _check_fc_bias(head: Eagle3Head, layout: str) -> None:
    if head.fc.bias is not None and layout != "sglang":
        raise ValueError(f"this EAGLE-3 head has a bias on fc, which the {layout!r} layout cannot hold (its loader "
                         "builds fc without one and would drop it): export it with layout 'sglang' (config bias: "
                         "true)")


def export_config(head: Eagle3Head, layout: str, target_config=None, verifier: str | None = None) -> dict:
    """config.json of `head` in `layout`; verifier names the target for the speculators layout (a hub id or a
    directory), else target_config's name_or_path."""
    _check_fc_bias(head, layout)
    indices = _target_indices(head, target_config)
    fields = llama_fields(head)
    wider = head.target_hidden_size != head.config.hidden_size  # written only then: SafeAILab reads its presence
    extra = {"draft_vocab_size": head.draft_vocab_size, **({"target_hidden_size": head.target_hidden_size} if wider
                                                           else {})}
    if layout == "speculators":
        return {"architectures": [SPECULATORS_ARCH], "speculators_model_type": "eagle3",
                "transformer_layer_config": fields, **extra,
                "norm_before_residual": head.midlayer.norm_before_residual,
                "eagle_aux_hidden_state_layer_ids": None if indices is None else list(indices),
                "speculators_config": _speculators_config(target_config, verifier)}
    if head.midlayer.norm_before_residual:
        raise ValueError(f"a head with norm_before_residual has no {layout!r} spelling; use the speculators layout")
    if layout == "eagle":
        if indices is not None:
            raise ValueError(f"the SafeAILab layout always reads the default layers; this head reads hidden-state "
                             f"indices {indices}: use the sglang or speculators layout")
        return {"architectures": ["LlamaForCausalLM"], **fields, **extra}
    if head.fc.bias is not None:
        fields["bias"] = True
    eagle_config = {"use_aux_hidden_state": True}
    if indices is not None:
        eagle_config["eagle_aux_hidden_state_layer_ids"] = sglang_aux_ids(tuple(indices))
    return {"architectures": [SGLANG_ARCH], **fields, **extra, "eagle_config": eagle_config}


def _speculators_config(target_config, verifier: str | None) -> dict:
    name = verifier or (None if target_config is None else target_config.name_or_path)
    if not name:
        raise ValueError("the speculators layout names the head's target in speculators_config.verifier.name_or_path "
                         "(vLLM loads it when it serves the head's folder): pass verifier='ORG/MODEL' or the "
                         "target's directory (train-head --verifier)")
    architectures = [] if target_config is None else list(target_config.architectures or [])
    verifier = {"name_or_path": name, "architectures": architectures}
    return {"algorithm": "eagle3", "default_proposal_method": "greedy", "verifier": verifier,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}]}


def export_state(head: Eagle3Head, layout: str) -> dict:
    """The head's weights under the layout's names (the rotary frequencies are not weights)."""
    state = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("rotary_emb."):
            continue
        if layout == "speculators" and name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        state[name] = tensor.detach().to("cpu").contiguous().clone()
    o_bias = "midlayer.self_attn.o_proj.bias"
    if layout == "sglang" and head.fc.bias is not None and o_bias not in state:  # SGLang's o_proj follows "bias"
        state[o_bias] = torch.zeros_like(head.fc.bias)
    return state


def save_eagle3_head(head: Eagle3Head, out_dir: str, layout: str = "eagle", target_config=None,
                     verifier: str | None = None) -> None:
    """Write `head` to out_dir as config.json + model.safetensors in `layout` ("eagle", "sglang" or "speculators").
    target_config (the target's config) tells whether the head's layers are the default ones; verifier (a hub id
    or a directory; default target_config's name_or_path) is the target the speculators config names."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    config = export_config(head, layout, target_config, verifier)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(export_state(head, layout), os.path.join(out_dir, "model.safetensors"))

