"""EAGLE-3 draft heads: the three published checkpoint layouts, the head's forward, its draft vocabulary.

Facts, from the public code (paths in the repositories named):
- Features. The target's hidden states ENTERING decoder layers 2, N//2, N-3 (SafeAILab/EAGLE
  eagle/model/modeling_llama_kv.py: `if idx==len(self.layers)-3 or idx==len(self.layers)//2 or idx==2:
  all_hidden_states += (hidden_states,)` before layer idx runs), concatenated (3H). In transformers'
  `output_hidden_states` (index 0 = embeddings, index i = input of layer i) these are indices [2, N//2, N-3].
  Index N there is the last layer's output AFTER the final norm; the engines capture it before the norm.
- Aux layer ids in configs, two conventions:
  SGLang/SpecForge `eagle_config.eagle_aux_hidden_state_layer_ids` = outputs of layers (SpecForge
  modeling/target/eagle3_target_model.py hooks layers[id] outputs, default [1, N//2-1, N-4]; sglang
  srt/models/llama.py set_eagle3_layers_to_capture captures before layer id+1). sglang PR #25454 (2026-05) adds the 1
  only when ids[0] == 1 (ids starting at 2 are inputs, e.g. [2, 30, 58]); we follow that rule.
  vLLM/speculators top-level `eagle_aux_hidden_state_layer_ids` = inputs of layers, used as given (vllm
  v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config, models/llama.py captures before layer id;
  speculators models/utils.py resolve_target_layer_ids: default [2, N//2, N-3], id N allowed).
- Decoder layer (cnets.py LlamaDecoderLayeremb, sglang models/llama_eagle3.py, speculators
  models/eagle3/model_definitions.py Eagle3FirstLayerMixin), h the H-wide state:
      x  = cat(input_layernorm(embed), hidden_norm(h))               (2H; q/k/v: 2H -> heads, o: heads -> H)
      r  = h   (speculators/vLLM `norm_before_residual`: r = hidden_norm(h))
      h1 = r + o_proj(attention(x));   h' = h1 + mlp(post_attention_layernorm(h1))
  draft logits = lm_head(norm(h')) over the draft vocabulary; the next tree level is fed h' (pre-norm).
- fc: Linear(3 * target_hidden -> H, bias=False) (cnets.py, speculators core.py; sglang: config.bias, default False),
  applied only when the input is the 3H target feature (`if hidden_states.shape[-1] != inputs_embeds.shape[-1]`).
  q/k/v bias: none in SafeAILab/SpecForge, `attention_bias` in speculators/vLLM (False in every published head).
- RoPE: the head's OWN config (rope_theta 10000 when absent: eagle/traineagle3/config.json, the LLaMA-3.1 head's, has
  none, while the target's is 500000), head_dim = H / heads; positions as the target's.
- Vocabulary: `d2t` long (draft_vocab,): target id = draft id + d2t[draft id]; `t2d` bool (target_vocab,).
- Weight names: SafeAILab and SGLang `midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`,
  optional `embed_tokens.weight` (SGLang also accepts a `model.` prefix); speculators `layers.0.*` for `midlayer.*`
  (Eagle3DraftModel.layers; vLLM llama_eagle3.py maps `midlayer.` -> `layers.0.`), its Llama fields under
  `transformer_layer_config`. `target_hidden_size` (all three) widens fc to 3 * target_hidden; the head then needs
  its own embedding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from eagle_fsd.attention import ForwardState
from eagle_fsd.drafting.base import HeadDrafter
from eagle_fsd.drafting.head_io import HeadModule, load_weights, read_head_files
from eagle_fsd.hf import cache_kwargs

LAYOUTS = ("eagle", "sglang", "speculators")
SGLANG_ARCH, SPECULATORS_ARCH = "LlamaForCausalLMEagle3", "Eagle3Speculator"
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm")  # extra norms before fc (speculators gpt-oss, SpecForge)


# ----------------------------------------------------------------------------- the head
class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer: attention over cat(input_layernorm(embedding), hidden_norm(h)), residual h."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool = False, o_proj_bias: bool = False):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # the queries, keys and values read 2H
            out_features = self.self_attn.get_submodule(name).out_features
            setattr(self.self_attn, name, nn.Linear(2 * hidden, out_features, bias=config.attention_bias))
        if o_proj_bias and self.self_attn.o_proj.bias is None:  # SGLang heads with "bias": true (see eagle3_export)
            o_proj = self.self_attn.o_proj
            self.self_attn.o_proj = nn.Linear(o_proj.in_features, o_proj.out_features, bias=True)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds, hidden, position_embeddings, position_ids, attention_mask, cache=None,
                backend: str = "auto"):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attn_in = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attn_out, _ = self.self_attn(attn_in, position_embeddings=position_embeddings, attention_mask=attention_mask,
                                     position_ids=position_ids, eagle_fsd_forward=ForwardState(backend),
                                     **cache_kwargs(self.self_attn, cache))
        hidden = residual + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(HeadModule):
    """EAGLE-3 draft head: fc over the concatenated target features, one Eagle3Layer, final norm, lm_head over the
    draft vocabulary, and the buffers d2t / t2d mapping draft ids to target ids. Its own embedding only when the
    checkpoint has one (heads whose hidden size differs from the target's)."""

    def __init__(self, config: LlamaConfig, draft_vocab_size: int, target_hidden_size: int | None = None,
                 num_aux: int = 3, norm_before_residual: bool = False, own_embedding: bool = False,
                 fc_bias: bool = False, o_proj_bias: bool = False):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.target_hidden_size = target_hidden_size or hidden
        self.aux_hidden_indices: tuple[int, ...] | None = None  # None: the default (2, N//2, N-3)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embedding else None
        self.fc = nn.Linear(num_aux * self.target_hidden_size, hidden, bias=fc_bias)
        self.midlayer = Eagle3Layer(config, norm_before_residual, o_proj_bias)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    def draft_to_target_ids(self) -> torch.Tensor:
        """(draft_vocab,) long: the target id of each draft id, draft id + d2t[draft id]."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def forward(self, token_embeds, hidden, position_ids, attention_mask, cache=None, backend: str = "auto"):
        """token_embeds (B, T, H); hidden (B, T, k * target_hidden) target features, or (B, T, H) the draft's own
        state at later tree levels -> (new hidden (B, T, H) pre-norm, draft logits (B, T, draft_vocab)); attention
        by `backend` (eagle_fsd.attention)."""
        hidden = self.hidden(token_embeds, hidden, position_ids, attention_mask, cache, backend)
        return hidden, self.logits(hidden)

    def hidden(self, token_embeds, hidden, position_ids, attention_mask, cache=None, backend: str = "auto"):
        """forward's new hidden states alone (pre-norm, what the next tree level reads)."""
        hidden = hidden.to(self.fc.weight.dtype)
        if hidden.shape[-1] == self.fc.in_features:
            hidden = self.fc(hidden)
        elif hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"EAGLE-3 head takes hidden states of width {self.fc.in_features} (target features) or "
                             f"{self.config.hidden_size} (its own state); got {hidden.shape[-1]}")
        position_embeddings = self.rotary_emb(hidden, position_ids)
        return self.midlayer(token_embeds.to(hidden.dtype), hidden, position_embeddings, position_ids,
                             attention_mask, cache, backend)

    def logits(self, hidden):
        """Draft logits over the draft vocabulary: lm_head(norm(h))."""
        return self.lm_head(self.norm(hidden))


# ----------------------------------------------------------------------------- layouts
def detect_layout(raw: dict) -> str | None:
    """'speculators', 'sglang', 'eagle' (SafeAILab) or None for a config.json dict that is no EAGLE-3 head."""
    archs = raw.get("architectures") or []
    if raw.get("speculators_model_type") == "eagle3" or SPECULATORS_ARCH in archs:
        return "speculators"
    if SGLANG_ARCH in archs:
        return "sglang"
    if "draft_vocab_size" in raw and (not archs or "LlamaForCausalLM" in archs):
        return "eagle"
    return None


def is_eagle3(raw: dict) -> bool:
    return detect_layout(raw) is not None


@dataclass(frozen=True)
class Eagle3Format:
    """What a config.json says about a head, whatever its layout."""
    layout: str
    config: LlamaConfig  # the decoder layer's fields; vocab_size is the target's vocabulary
    draft_vocab_size: int | None  # None: not given (SGLang then uses the full vocabulary and the target's lm_head)
    target_hidden_size: int
    norm_before_residual: bool
    aux_ids: tuple[int, ...] | None  # as written in the config (None: the default layers)


_NOT_LLAMA = ("architectures", "draft_vocab_size", "eagle_config", "target_hidden_size", "norm_before_residual",
              "torch_dtype", "dtype", "transformers_version", "auto_map")


def _llama_config(fields: dict, path: str) -> LlamaConfig:
    model_type = fields.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"EAGLE-3 head {path!r} has a {model_type!r} decoder layer; only Llama-style EAGLE-3 heads "
                         "are supported")
    config = LlamaConfig(**{k: v for k, v in fields.items() if k not in _NOT_LLAMA})
    if config.num_hidden_layers != 1:
        raise ValueError(f"EAGLE-3 head {path!r} has num_hidden_layers={config.num_hidden_layers}; only one-layer "
                         "heads (every published EAGLE-3 head) are supported")
    return config


def read_format(raw: dict, path: str = "<config>") -> Eagle3Format:
    layout = detect_layout(raw)
    if layout is None:
        raise ValueError(f"{path!r} is no EAGLE-3 head this loader knows: expected architectures "
                         f"[{SGLANG_ARCH!r}] (SGLang/SpecForge), [{SPECULATORS_ARCH!r}] with speculators_model_type "
                         f"'eagle3' (vLLM speculators), or a Llama config with draft_vocab_size (SafeAILab); got "
                         f"architectures={raw.get('architectures')}")
    for flag in UNSUPPORTED_FLAGS:
        if raw.get(flag):
            raise ValueError(f"EAGLE-3 head {path!r} sets {flag}=true (an extra norm before fc), which this loader "
                             "does not implement")
    fields = raw.get("transformer_layer_config", {}) if layout == "speculators" else raw
    config = _llama_config(fields, path)
    eagle_config = raw.get("eagle_config") or {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids") if layout == "speculators" else \
        eagle_config.get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Format(layout, config, raw.get("draft_vocab_size"),
                        raw.get("target_hidden_size") or config.hidden_size,
                        bool(raw.get("norm_before_residual", False)), None if ids is None else tuple(ids))


def default_aux_indices(num_layers: int) -> tuple[int, ...]:
    """output_hidden_states indices of the inputs of layers 2, N//2, N-3 (EAGLE-3's default features)."""
    return (2, num_layers // 2, num_layers - 3)


def aux_hidden_indices(fmt: Eagle3Format, num_layers: int, path: str = "<config>") -> tuple[int, ...]:
    """The target's output_hidden_states indices the head reads, checked against the target's depth."""
    if fmt.aux_ids is None:
        indices = default_aux_indices(num_layers)
    elif fmt.layout != "speculators" and fmt.aux_ids[0] == 1:  # SGLang/SpecForge: outputs of layers
        indices = tuple(i + 1 for i in fmt.aux_ids)
    else:
        indices = fmt.aux_ids
    if any(not 0 <= i <= num_layers for i in indices) or len(set(indices)) != len(indices):
        raise ValueError(f"EAGLE-3 head {path!r}: aux layer ids {fmt.aux_ids} give hidden-state indices {indices}, "
                         f"which must be distinct and within [0, {num_layers}] for a target with num_hidden_layers="
                         f"{num_layers}: this head was trained for another model (or fix "
                         "eagle_aux_hidden_state_layer_ids in its config.json)")
    return indices


# ----------------------------------------------------------------------------- loading
def canonical_state(state: dict, path: str = "<weights>") -> dict:
    """Weights under this module's names: drop SGLang's `model.` prefix, speculators' `layers.0.` -> `midlayer.`."""
    out = {}
    for key, tensor in state.items():
        name = key.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        elif name.startswith("layers."):
            raise ValueError(f"EAGLE-3 head {path!r} has weight {key!r} of a second decoder layer; only one-layer "
                             "heads are supported")
        out[name] = tensor
    return out


def _fill_defaults(state: dict, fmt: Eagle3Format, target: nn.Module) -> None:
    """What a checkpoint may leave out: without draft_vocab_size SGLang drafts over the full vocabulary with the
    target's lm_head; without d2t the draft vocabulary is the target's (identity map); t2d follows from d2t."""
    vocab = fmt.config.vocab_size
    if "lm_head.weight" not in state and fmt.draft_vocab_size is None:
        state["lm_head.weight"] = target.get_output_embeddings().weight.detach()[:vocab].clone()
    draft_vocab = state["lm_head.weight"].shape[0] if "lm_head.weight" in state else fmt.draft_vocab_size
    if "d2t" not in state and draft_vocab == vocab:
        state["d2t"] = torch.zeros(vocab, dtype=torch.long)
    if "t2d" not in state and "d2t" in state:
        ids = torch.arange(state["d2t"].numel()) + state["d2t"].long()
        if int(ids.min()) >= 0 and int(ids.max()) < vocab:  # out-of-range ids are reported by _check_fits
            state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)


def _check_fits(fmt: Eagle3Format, state: dict, target: nn.Module, path: str) -> None:
    """Hidden sizes and vocabularies of the head against the target's (ValueError naming the value and the fix)."""
    vocab, hidden = target.get_input_embeddings().weight.shape
    if fmt.target_hidden_size != hidden:
        raise ValueError(f"EAGLE-3 head {path!r} reads target hidden states of size {fmt.target_hidden_size} but the "
                         f"target has hidden_size {hidden}: this head was trained for another model")
    if fmt.config.hidden_size != hidden and "embed_tokens.weight" not in state:
        raise ValueError(f"EAGLE-3 head {path!r} has hidden_size {fmt.config.hidden_size} != the target's {hidden} "
                         "but no embed_tokens.weight of its own: add the head's embedding to its weights")
    if fmt.config.vocab_size != vocab:
        raise ValueError(f"EAGLE-3 head {path!r} has vocab_size {fmt.config.vocab_size} but the target has {vocab}: "
                         "this head was trained for another model")
    if "t2d" in state and state["t2d"].numel() != vocab:
        raise ValueError(f"EAGLE-3 head {path!r}: t2d covers {state['t2d'].numel()} target ids but the target's "
                         f"vocabulary has {vocab}: this head was trained for another model")
    if "d2t" in state:
        ids = torch.arange(state["d2t"].numel()) + state["d2t"].long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"EAGLE-3 head {path!r}: d2t maps draft ids to target ids in [{int(ids.min())}, "
                             f"{int(ids.max())}], outside the target's vocabulary [0, {vocab}): this head was "
                             "trained for another model")


def build_head(fmt: Eagle3Format, state: dict, num_aux: int = 3) -> Eagle3Head:
    """An Eagle3Head holding `state` (canonical names); ValueError listing missing / unexpected / misshapen weights."""
    draft_vocab = state["lm_head.weight"].shape[0] if "lm_head.weight" in state else (fmt.draft_vocab_size or 0)
    head = Eagle3Head(fmt.config, draft_vocab, fmt.target_hidden_size, num_aux, fmt.norm_before_residual,
                      own_embedding="embed_tokens.weight" in state, fc_bias="fc.bias" in state,
                      o_proj_bias="midlayer.self_attn.o_proj.bias" in state)
    load_weights(head, state, "EAGLE-3 head", fmt.layout)
    return head


def load_eagle3_head(path: str, target: nn.Module) -> tuple[Eagle3Head, tuple[int, ...]]:
    """Load an EAGLE-3 head in any of the three layouts (local dir or hub id) and check it fits `target`. Returns the
    head in the target's dtype and device, and the target's output_hidden_states indices it reads (concatenated in
    that order into its fc input)."""
    raw, state = read_head_files(path)
    fmt = read_format(raw, path)
    indices = aux_hidden_indices(fmt, target.config.num_hidden_layers, path)
    state = canonical_state(state, path)
    _fill_defaults(state, fmt, target)
    _check_fits(fmt, state, target, path)
    fmt.config._attn_implementation = target.config._attn_implementation
    try:
        head = build_head(fmt, state, num_aux=len(indices))
    except ValueError as err:
        raise ValueError(f"EAGLE-3 head {path!r}: {err}") from err
    head.aux_hidden_indices = None if fmt.aux_ids is None else indices
    return head.cast(target.dtype).to(target.device).eval(), indices


# ----------------------------------------------------------------------------- drafting (sketch)
def aux_features(hidden_states, indices: tuple[int, ...]) -> torch.Tensor:
    """The head's input from transformers' output_hidden_states: cat of hidden_states[i] for i in indices, (.., k*H).
    Index N there is after the final norm, unlike the engines' capture: the engine integration must take the last
    layer's output before the norm for it."""
    return torch.cat([hidden_states[i] for i in indices], dim=-1)


class OwnVocabulary:
    """An EAGLE-3 head's draft vocabulary is part of the head (d2t): the tuner's reduced vocabularies do not apply.
    draft_vocab: its target ids (None when it is the full one)."""

    def __init__(self, draft_vocab: torch.Tensor | None):
        self.draft_vocab = draft_vocab

    def set_draft_vocab(self, ids) -> None:
        if ids is not None and ids is not self.draft_vocab:
            raise ValueError("an EAGLE-3 head drafts over its own draft vocabulary (d2t); it cannot be reduced")


class Eagle3Drafter(HeadDrafter):
    """Drafts with an EAGLE-3 head (the Drafter contract of eagle_fsd.drafting.base): target_hidden is the (T, k * H)
    concatenation of the target's hidden states at `feature_layers` (output_hidden_states indices, what the engine
    captures for it); tree levels feed the draft's own (H,) state. draft_vocab: the target ids of the head's draft
    vocabulary (None when it is the full one)."""
    reducible_vocab = False  # the draft vocabulary is the head's own (d2t): the tuner does not cut it

    def __init__(self, head: Eagle3Head, target: nn.Module, feature_layers: tuple[int, ...] | None = None):
        ids = head.draft_to_target_ids()
        full = ids.numel() == target.config.vocab_size and bool((ids == torch.arange(ids.numel())).all())
        super().__init__(head, target, OwnVocabulary(None if full else ids), "EAGLE-3 head")
        layers = target.config.num_hidden_layers
        self.feature_layers = tuple(feature_layers or default_aux_indices(layers))
        if max(self.feature_layers) >= layers:
            raise ValueError(f"EAGLE-3 feature layers {self.feature_layers}: index {layers} (the last layer's output "
                             "before the final norm) is not supported; use inputs of layers 0..N-1")
        self.embed = head.embed_tokens if head.embed_tokens is not None else target.get_input_embeddings()

    @classmethod
    def load(cls, source: str, target: nn.Module, tokenizer=None) -> Eagle3Drafter:
        """The drafter of the EAGLE-3 head at `source` (any of its layouts), checked against `target`."""
        head, layers = load_eagle3_head(source, target)
        return cls(head, target, layers)

    def _hidden(self, tokens, hidden, mask, positions):
        new_hidden = self.head.hidden(self.embed(tokens)[None], hidden[None], positions[None], mask, self.cache,
                                      self.run.backend)[0]
        return new_hidden, new_hidden

    def _logits(self, hidden):
        return self.head.logits(hidden)
