"""The EAGLE-1/2 drafter: a head of one decoder layer over [token embedding, target feature], drafting with the
target's own embedding and lm_head."""
from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from eagle_fsd.attention import ForwardState
from eagle_fsd.drafting.base import DraftHead, HeadDrafter
from eagle_fsd.drafting.head_io import HeadModule, head_config, load_weights, read_head_files
from eagle_fsd.hf import cache_kwargs


class EagleHead(HeadModule):
    """EAGLE-1/2 draft head: fc(2H -> H) over [token embedding, target feature], then one Llama decoder layer
    without input layernorm. No embedding or lm_head of its own: both are the target's."""

    def __init__(self, config: LlamaConfig, bias: bool = True, qkv_bias: bool = False):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=bias)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()
        if qkv_bias:  # Qwen2-style heads: bias on q, k, v only
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                old = attn.get_submodule(name)
                setattr(attn, name, nn.Linear(old.in_features, old.out_features, bias=True))
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, token_embeds, features, position_ids, attention_mask, cache=None, backend: str = "auto"):
        """token_embeds, features (B, T, H) -> draft features (B, T, H); attention by `backend` (eagle_fsd.attention)."""
        hidden = self.fc(torch.cat([token_embeds, features.to(token_embeds.dtype)], dim=-1))
        position_embeddings = self.rotary_emb(hidden, position_ids)
        layer = self.layers[0]
        out = layer(hidden, attention_mask=attention_mask, position_ids=position_ids,
                    position_embeddings=position_embeddings, eagle_fsd_forward=ForwardState(backend),
                    **cache_kwargs(layer, cache))
        return out[0] if isinstance(out, tuple) else out


def load_eagle_head(path: str, target: nn.Module) -> EagleHead:
    """Load a head in the published EAGLE-1/2 layout and check it fits `target`."""
    raw, state = read_head_files(path)
    config, bias, qkv_bias = head_config(raw)
    target_cfg = target.config
    vocab, hidden = target.get_input_embeddings().weight.shape
    if config.hidden_size != hidden:
        raise ValueError(f"EAGLE head {path!r} has hidden_size {config.hidden_size} but the target has {hidden}: "
                         "this head was trained for another model")
    if config.vocab_size != vocab:
        raise ValueError(f"EAGLE head {path!r} has vocab_size {config.vocab_size} but the target has {vocab}: "
                         "this head was trained for another model")
    emb = state.pop("embed_tokens.weight", None)
    if emb is not None and tuple(emb.shape) != (vocab, hidden):
        raise ValueError(f"EAGLE head {path!r} embedding shape {tuple(emb.shape)} != target's {(vocab, hidden)}")
    config._attn_implementation = target_cfg._attn_implementation
    head = EagleHead(config, bias=bias, qkv_bias=qkv_bias)
    load_weights(head, state, f"EAGLE head {path!r}", "EAGLE-1/2")
    return head.cast(target.dtype).to(target.device).eval()


class EagleDrafter(HeadDrafter):
    """Drafts with an EAGLE head: input at position t is (embed(x_{t+1}), feature f_t)."""

    def __init__(self, head: EagleHead, target: nn.Module):
        if head.config.hidden_size != target.config.hidden_size:
            raise ValueError(f"EAGLE head hidden_size {head.config.hidden_size} != target's {target.config.hidden_size}")
        super().__init__(head, target, DraftHead(target, target.config.vocab_size), "EAGLE head")
        self.embed = target.get_input_embeddings()

    @classmethod
    def load(cls, source: str, target: nn.Module, tokenizer=None) -> EagleDrafter:
        """The drafter of the EAGLE-1/2 head at `source` (a directory or hub id), checked against `target`."""
        return cls(load_eagle_head(source, target), target)

    def _hidden(self, tokens, features, mask, positions):
        hidden = self.head(self.embed(tokens)[None], features[None], positions[None], mask, self.cache,
                           self.run.backend)[0]
        return hidden, hidden
