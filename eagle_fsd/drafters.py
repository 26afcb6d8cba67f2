"""Drafters: an EAGLE-1/2 head or any causal LM sharing the target's tokenizer, and the EAGLE-2 tree growth.

A drafter keeps its own cache of committed context and offers:
  prefill(prompt_ids, root, target_hidden) / extend(tokens, target_hidden) -> (draft logits at the root, root state)
  forward_level(tokens, parent_state, level, level_mask) -> (draft logits at each node, node states)
  rollback()  -- drop the scratch entries of the tree levels
  draft_vocab -- None, or the target ids of a reduced draft vocabulary (FR-Spec): the draft lm_head then scores only
                 those tokens, so logits are (.., len(draft_vocab)); verification still uses the full vocabulary.
Context positions: after `extend`, the drafter has consumed `length` inputs; tree level s (0-based) sits at position
length + s for both kinds (EAGLE pairs feature f_t with token x_{t+1}, one input fewer than the LM, one position less).
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from eagle_fsd.attention import ForwardState, check_attention_support
from eagle_fsd.cache import TreeCache
from eagle_fsd.hf import cache_kwargs, causal_mask, decoder_forward, prefix_tree_mask
from eagle_fsd.prepack import PackedLinear, pack_weight, packed_linear
from eagle_fsd.quant import QuantLinear, int4_fits
from eagle_fsd.tree.dynamic import DraftTree, grow_pool, select_tree


class EagleHead(nn.Module):
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
                old = getattr(attn, name)
                setattr(attn, name, nn.Linear(old.in_features, old.out_features, bias=True))
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def cast(self, dtype: torch.dtype) -> "EagleHead":
        """Cast the weights, keeping the rotary frequencies in fp32 as the target's are (a bf16 inv_freq would let
        the draft's RoPE angles drift away from the target's as positions grow)."""
        self.fc.to(dtype)
        self.layers.to(dtype)
        return self

    def forward(self, token_embeds, features, position_ids, attention_mask, cache=None, backend: str = "auto"):
        """token_embeds, features (B, T, H) -> draft features (B, T, H); attention by `backend` (eagle_fsd.attention)."""
        hidden = self.fc(torch.cat([token_embeds, features.to(token_embeds.dtype)], dim=-1))
        position_embeddings = self.rotary_emb(hidden, position_ids)
        layer = self.layers[0]
        out = layer(hidden, attention_mask=attention_mask, position_ids=position_ids,
                    position_embeddings=position_embeddings, eagle_fsd_forward=ForwardState(backend),
                    **cache_kwargs(layer, cache))
        return out[0] if isinstance(out, tuple) else out


def _head_file(path: str, name: str) -> str | None:
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


def _read_head_files(path: str):
    """config dict and state dict of a published EAGLE-1/2 head (local dir or hub id)."""
    config_file = _head_file(path, "config.json")
    if config_file is None:
        raise FileNotFoundError(f"EAGLE head {path!r} has no config.json")
    with open(config_file) as f:
        config = json.load(f)
    if (weights := _head_file(path, "model.safetensors")) is not None:
        from safetensors.torch import load_file

        return config, load_file(weights)
    if (weights := _head_file(path, "pytorch_model.bin")) is not None:
        return config, torch.load(weights, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"EAGLE head {path!r} has neither model.safetensors nor pytorch_model.bin")


def head_config(raw: dict) -> tuple[LlamaConfig, bool, bool]:
    keys = {k: v for k, v in raw.items() if k not in ("bias", "qkv_bias", "architectures")}
    config = LlamaConfig(**keys)
    config.num_hidden_layers = 1
    return config, bool(raw.get("bias", True)), bool(raw.get("qkv_bias", False))


def load_eagle_head(path: str, target: nn.Module) -> EagleHead:
    """Load a head in the published EAGLE-1/2 layout and check it fits `target`."""
    raw, state = _read_head_files(path)
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


def load_weights(head: nn.Module, state: dict, what: str, layout: str) -> None:
    """Load `state` into `head` exactly; ValueError naming `what` and `layout` for misshapen, missing or unexpected
    weights."""
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as err:  # wrong tensor shapes
        raise ValueError(f"{what} does not fit the {layout} layout for this config: {err}") from err
    if missing or unexpected:
        raise ValueError(f"{what} does not match the {layout} layout: missing {missing}, unexpected {unexpected}")


class DraftHead:
    """The draft lm_head, optionally restricted to a draft vocabulary: logits = h W[ids]^T (+ b[ids]). `owner`: the
    model whose output embeddings score (read at each call, so a prepacked lm_head is the one used)."""

    def __init__(self, owner: nn.Module, width: int):
        self.owner, self.width = owner, width  # width: the target's logit width
        self.draft_vocab = None
        self.weight, self.bias, self.packed, self.quant = None, None, None, None

    @property
    def lm_head(self) -> nn.Module:
        return self.owner.get_output_embeddings()

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Score only the target ids `ids` (None: the whole vocabulary)."""
        if ids is None:
            self.draft_vocab, self.weight, self.bias, self.packed, self.quant = None, None, None, None, None
            return
        weight = self.lm_head.weight
        ids = ids.to(weight.device, torch.long)
        if ids.numel() == 0 or int(ids.max()) >= min(weight.shape[0], self.width) or int(ids.min()) < 0:
            raise ValueError(f"draft vocabulary ids must lie in [0, {min(weight.shape[0], self.width)}); got "
                             f"{ids.numel()} ids in [{int(ids.min()) if ids.numel() else '-'}, "
                             f"{int(ids.max()) if ids.numel() else '-'}]")
        self.draft_vocab = ids
        self.weight = weight.detach()[ids].contiguous()
        bias = getattr(self.lm_head, "bias", None)
        self.bias = None if bias is None else bias.detach()[ids].contiguous()
        self.packed = pack_weight(self.weight) if isinstance(self.lm_head, PackedLinear) else None
        bits = self.lm_head.bits if isinstance(self.lm_head, QuantLinear) else 0
        self.quant = None
        if bits == 8 or (bits == 4 and int4_fits(*self.weight.shape)):
            self.quant = QuantLinear.from_weight(self.weight, self.bias, bits)
            self.quant.packed = pack_weight(self.weight) if self.lm_head.packed is not None else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.draft_vocab is not None:
            if self.quant is not None:  # the slice runs as the full head is told to (unpacked, original_weights)
                self.quant.use_packed, self.quant.use_quant = self.lm_head.use_packed, self.lm_head.use_quant
                return self.quant(hidden)
            if self.packed is not None and self.lm_head.use_packed:
                return packed_linear(hidden, self.packed, self.bias)
            return F.linear(hidden, self.weight, self.bias)
        logits = self.lm_head(hidden)
        width = logits.shape[-1]
        if width > self.width:  # padding rows beyond the target's vocabulary are not tokens
            return logits[..., : self.width]
        if width < self.width:
            return F.pad(logits, (0, self.width - width), value=float("-inf"))
        return logits


class EagleDrafter:
    """Drafts with an EAGLE head: input at position t is (embed(x_{t+1}), feature f_t). attention: the head's
    attention backend (eagle_fsd.attention)."""

    def __init__(self, head: EagleHead, target: nn.Module, attention: str = "auto"):
        if head.fc.weight.dtype != target.dtype:
            raise ValueError(f"EAGLE head dtype {head.fc.weight.dtype} != target dtype {target.dtype}; "
                             "cast the head with head.cast(target.dtype)")
        if head.config.hidden_size != target.config.hidden_size:
            raise ValueError(f"EAGLE head hidden_size {head.config.hidden_size} != target's {target.config.hidden_size}")
        check_attention_support(target.config)
        self.head, self.target, self.attention = head, target, attention
        self.embed = target.get_input_embeddings()
        self.draft_head = DraftHead(target, target.config.vocab_size)

    @property
    def module(self) -> nn.Module:
        """The drafter's own weights (the target's embedding and lm_head are the target's)."""
        return self.head

    @property
    def draft_vocab(self):
        return self.draft_head.draft_vocab

    def reset(self, max_len: int):
        self.cache = TreeCache(1, max_len)
        self.length = 0

    def _run(self, tokens, features, mask, positions):
        return self.head(self.embed(tokens)[None], features[None], positions[None], mask, self.cache,
                         self.attention)[0]

    def prefill(self, prompt_ids, root, target_hidden):
        return self.extend(torch.cat([prompt_ids[1:], root.reshape(1)]), target_hidden)

    def extend(self, tokens, target_hidden):
        n = tokens.numel()
        positions = self.length + torch.arange(n, device=tokens.device)
        hidden = self._run(tokens, target_hidden, causal_mask(self.length, n, tokens.device), positions)
        self.length += n
        last = hidden[-1:]
        return self.draft_head(last)[0], last[0]

    def forward_level(self, tokens, parent_state, level, level_mask):
        k = tokens.numel()
        positions = torch.full((k,), self.length + level, device=tokens.device)
        hidden = self._run(tokens, parent_state, prefix_tree_mask(self.length, level_mask), positions)
        return self.draft_head(hidden), hidden

    def rollback(self):
        self.cache.crop(self.length)


class LMDrafter:
    """Drafts with a small causal LM that shares the target's tokenizer (training-free). attention: its attention
    backend (eagle_fsd.attention)."""

    def __init__(self, model: nn.Module, vocab_size: int, attention: str = "auto"):
        check_attention_support(model.config)
        self.model = model
        self.attention = attention
        self.vocab_size = vocab_size  # the target's logit width; the draft's is cut or padded to it
        self.draft_head = DraftHead(model, vocab_size)

    @property
    def module(self) -> nn.Module:
        return self.model

    @property
    def draft_vocab(self):
        return self.draft_head.draft_vocab

    def reset(self, max_len: int):
        self.cache = TreeCache(self.model.config.num_hidden_layers, max_len)
        self.length = 0

    def prefill(self, prompt_ids, root, target_hidden=None):
        return self.extend(torch.cat([prompt_ids, root.reshape(1)]))

    def extend(self, tokens, target_hidden=None):
        n = tokens.numel()
        positions = self.length + torch.arange(n, device=tokens.device)
        hidden = decoder_forward(self.model, tokens, self.cache, causal_mask(self.length, n, tokens.device), positions,
                                 self.attention)
        self.length += n
        return self.draft_head(hidden[-1:])[0], None

    def forward_level(self, tokens, parent_state, level, level_mask):
        positions = torch.full((tokens.numel(),), self.length + level, device=tokens.device)
        hidden = decoder_forward(self.model, tokens, self.cache, prefix_tree_mask(self.length, level_mask), positions,
                                 self.attention)
        return self.draft_head(hidden), None

    def rollback(self):
        self.cache.crop(self.length)


def grow_tree(drafter, root_token, root_logits, root_state, total_token: int, depth: int, top_k: int) -> DraftTree:
    """EAGLE-2 drafting: `depth` draft forwards of top_k nodes each, then the global rerank to total_token nodes."""
    pool = grow_pool(drafter.forward_level, root_logits, root_state, depth, top_k, drafter.draft_vocab)
    drafter.rollback()
    return select_tree(root_token, pool, total_token, max_depth=depth + 1)
