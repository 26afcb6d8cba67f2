"""Drafters: an EAGLE-1/2 head or any causal LM sharing the target's tokenizer (EAGLE-3: eagle_fsd.eagle3), the
Drafter base they share, and the EAGLE-2 tree growth.

A drafter (Drafter) keeps its own cache of committed context and offers:
  prefill(prompt_ids, root, target_hidden) / extend(tokens, target_hidden) -> (draft logits at the root, root state)
  forward_level(tokens, parent_state, level, level_mask) -> (draft logits at each node, node states)
  rollback()  -- drop the scratch entries of the tree levels; rewind(length) -- forget the context after `length`
  draft_vocab -- None, or the target ids of a reduced draft vocabulary (FR-Spec): the draft lm_head then scores only
                 those tokens, so logits are (.., len(draft_vocab)); verification still uses the full vocabulary.
Context positions: after `extend`, the drafter has consumed `length` inputs; tree level s (0-based) sits at position
length + s for both kinds (EAGLE pairs feature f_t with token x_{t+1}, one input fewer than the LM, one position less).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from eagle_fsd.attention import ForwardState, check_attention_support
from eagle_fsd.cache import TreeCache
from eagle_fsd.fused_decoder import fused_decoder_forward, runs_fused
from eagle_fsd.hf import cache_kwargs, causal_mask, decoder_forward, prefix_tree_mask
from eagle_fsd.prepack import PackedLinear, pack_weight, packed_linear
from eagle_fsd.quant import QuantLinear, int4_fits
from eagle_fsd.target_quant import Int4Product, RowQuantLinear, own_product
from eagle_fsd.tree.dynamic import DraftTree, grow_pool, select_tree
from eagle_fsd.tree.shape import TreeShape


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
        if isinstance(self.lm_head, RowQuantLinear):  # a quantized head: its rows, rounded as the head rounds them
            int4 = isinstance(own_product(self.lm_head.product), Int4Product)
            self.quant = RowQuantLinear.from_weight(self.weight, self.bias, self.lm_head.activation_bits,
                                                   per_row=self.lm_head.product.per_row, four_bit=int4,
                                                   requantize=int4)
        elif bits == 8 or (bits == 4 and int4_fits(*self.weight.shape)):
            self.quant = QuantLinear.from_weight(self.weight, self.bias, bits)
            self.quant.packed = pack_weight(self.weight) if self.lm_head.packed is not None else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.draft_vocab is not None:
            if self.quant is not None:  # the slice runs as the full head is told to (unpacked, original_weights)
                self.quant.use_packed = self.lm_head.use_packed
                self.quant.use_quant = getattr(self.lm_head, "use_quant", True)
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


class Drafter:
    """The step contract every drafter keeps, and its cache bookkeeping. A drafter reads the committed context once
    (prefill, then extend per step), grows tree levels atop it as scratch (forward_level), and drops the scratch
    (rollback). `length` counts the inputs read; tree level s sits at position length + s.

    A subclass gives `module` (its own weights), `cache_layers`, `_hidden(tokens, inputs, mask, positions)` ->
    (hidden states (T, H) before the draft lm_head, the states the next tree level reads or None) and
    `_logits(hidden)` -> draft logits (T, V_draft). Declared capabilities:
      feature_layers    None: reads the target's final hidden states; EAGLE-3: those entering these layers
      reads_features    the inputs pair feature f_t with token x_{t+1} (EAGLE), so prefill skips the first token;
                        a drafter that does not reads a tree level's node exactly as extend would (same token, same
                        position, same context), so an accepted chain's level entries are kept (`keep_levels`)
                        instead of read again
      reducible_vocab   the tuner may cut the draft vocabulary to the most frequent tokens (FR-Spec)
      auto_quant        draft_quant "auto" may round its weights to int4 (an LM: big, with its own lm_head)
      assistant_model   a causal LM HF assisted generation can draft with (None: none)"""

    feature_layers: tuple[int, ...] | None = None
    reads_features = True
    reducible_vocab = True
    auto_quant = False
    assistant_model: nn.Module | None = None
    cache_layers = 1

    def __init__(self, draft_head, attention: str = "auto"):
        self.draft_head, self.attention = draft_head, attention
        self.cache, self.length = None, 0

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """None, or the target ids the draft logits score (a reduced vocabulary, or an EAGLE-3 head's own)."""
        return self.draft_head.draft_vocab

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Score only the target ids `ids` (None: the drafter's own vocabulary)."""
        self.draft_head.set_draft_vocab(ids)

    @contextmanager
    def drafting_over(self, ids: torch.Tensor | None):
        """The draft vocabulary `ids` inside the block, the one before it afterwards."""
        before = self.draft_vocab
        self.set_draft_vocab(ids)
        try:
            yield self
        finally:
            self.set_draft_vocab(before)

    def reset(self, max_len: int) -> None:
        self.cache = TreeCache(self.cache_layers, max_len)
        self.length = 0

    def prefill(self, prompt_ids, root, target_hidden=None):
        """Read the prompt and the first new token: (draft logits at the root, root state)."""
        tokens = prompt_ids[1:] if self.reads_features else prompt_ids
        return self.extend(torch.cat([tokens, root.reshape(1)]), target_hidden)

    def extend(self, tokens, target_hidden=None):
        """Read committed tokens (with the target's features at the positions before them, for a head)."""
        n = tokens.numel()
        positions = self.length + torch.arange(n, device=tokens.device)
        hidden, states = self._hidden(tokens, target_hidden, causal_mask(self.length, n, tokens.device), positions)
        self.length += n
        return self._logits(hidden[-1:])[0], None if states is None else states[-1]

    def forward_level(self, tokens, parent_state, level: int, level_mask):
        """One tree level: (draft logits at each node, node states), each node at position length + level."""
        positions = torch.full((tokens.numel(),), self.length + level, device=tokens.device)
        hidden, states = self._hidden(tokens, parent_state, prefix_tree_mask(self.length, level_mask), positions)
        return self._logits(hidden), states

    def rollback(self) -> None:
        """Drop the scratch entries of the tree levels (from the count; they stay in storage for keep_levels)."""
        self.cache.crop(self.length)

    def keep_levels(self, slots: torch.Tensor) -> None:
        """Commit the accepted chain's first nodes from the last tree's scratch: slots[i] is the scratch entry (level
        L's j-th node at L * top_k + j) of the node at depth i + 1, which sat at position length + i, where it is
        committed now. Only for a drafter that does not read features (its level entries equal extend's)."""
        if self.reads_features:
            raise ValueError("keep_levels: a drafter that reads the target's features must read accepted tokens again")
        self.cache.keep(self.length, slots)
        self.length += slots.numel()

    def rewind(self, length: int) -> None:
        """Forget the context after its first `length` inputs."""
        self.cache.crop(length)
        self.length = length

    def _logits(self, hidden):
        return self.draft_head(hidden)


class EagleDrafter(Drafter):
    """Drafts with an EAGLE head: input at position t is (embed(x_{t+1}), feature f_t). attention: the head's
    attention backend (eagle_fsd.attention)."""

    def __init__(self, head: EagleHead, target: nn.Module, attention: str = "auto"):
        if head.fc.weight.dtype != target.dtype:
            raise ValueError(f"EAGLE head dtype {head.fc.weight.dtype} != target dtype {target.dtype}; "
                             "cast the head with head.cast(target.dtype)")
        if head.config.hidden_size != target.config.hidden_size:
            raise ValueError(f"EAGLE head hidden_size {head.config.hidden_size} != target's {target.config.hidden_size}")
        check_attention_support(target.config)
        super().__init__(DraftHead(target, target.config.vocab_size), attention)
        self.head, self.target = head, target
        self.embed = target.get_input_embeddings()

    @property
    def module(self) -> nn.Module:
        """The drafter's own weights (the target's embedding and lm_head are the target's)."""
        return self.head

    def _hidden(self, tokens, features, mask, positions):
        hidden = self.head(self.embed(tokens)[None], features[None], positions[None], mask, self.cache,
                           self.attention)[0]
        return hidden, hidden


class LMDrafter(Drafter):
    """Drafts with a small causal LM that shares the target's tokenizer (training-free). attention: its attention
    backend (eagle_fsd.attention)."""
    reads_features = False
    auto_quant = True

    def __init__(self, model: nn.Module, vocab_size: int, attention: str = "auto"):
        check_attention_support(model.config)
        super().__init__(DraftHead(model, vocab_size), attention)  # cut or padded to the target's logit width
        self.model = model
        self.vocab_size = vocab_size
        self.cache_layers = model.config.num_hidden_layers

    @property
    def module(self) -> nn.Module:
        return self.model

    @property
    def assistant_model(self) -> nn.Module:
        return self.model

    def _hidden(self, tokens, target_hidden, mask, positions):
        if runs_fused(self.model):  # its norms in C++ too: a drafter's rounding moves acceptance only
            return fused_decoder_forward(self.model, tokens, self.cache, mask, positions, self.attention,
                                         exact=False), None
        return decoder_forward(self.model, tokens, self.cache, mask, positions, self.attention), None


def grow_tree(drafter: Drafter, root_token, root_logits, root_state, shape: TreeShape) -> DraftTree:
    """EAGLE-2 drafting: `shape.depth` draft forwards of `shape.branching` nodes each, then the global rerank to
    `shape.total_token` nodes."""
    pool = grow_pool(drafter.forward_level, root_logits, root_state, shape.depth, shape.branching, drafter.draft_vocab)
    drafter.rollback()
    return select_tree(root_token, pool, shape.total_token, max_depth=shape.depth + 1)
