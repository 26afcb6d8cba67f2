"""The proposer contract and what every drafter shares: the draft lm_head over a draft vocabulary, the drafter's
cache bookkeeping, the catch-up of what it has not read, and the EAGLE-2 tree growth.

A proposer offers `session(max_len, prompt, root, features)` for one generate call: the session drafts the tree of a
step (`draft`) and reads the step's emitted tokens (`read`). `Plain` proposes the root alone (plain decoding); a
`Drafter` grows an EAGLE-2 tree. A drafter keeps its own cache of committed context and offers:
  prefill(prompt_ids, root, target_hidden) / extend(tokens, target_hidden) -> (draft logits at the root, root state)
  forward_level(tokens, parent_state, level, level_mask) -> (draft logits at each node, node states)
  rollback()  -- drop the scratch entries of the tree levels; rewind(length) -- forget the context after `length`
  draft_vocab -- None, or the target ids of a reduced draft vocabulary (FR-Spec): the draft lm_head then scores only
                 those tokens, so logits are (.., len(draft_vocab)); verification still uses the full vocabulary.
Context positions: after `extend`, the drafter has consumed `length` inputs; tree level s (0-based) sits at position
length + s for both kinds (EAGLE pairs feature f_t with token x_{t+1}, one input fewer than the LM, one position less).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from eagle_fsd.attention import check_attention_support
from eagle_fsd.cache import TreeCache
from eagle_fsd.hf import causal_mask, prefix_tree_mask
from eagle_fsd.plan import ModelRun
from eagle_fsd.prepack import PackedLinear, pack_weight, packed_linear
from eagle_fsd.quant import QuantLinear, int4_fits
from eagle_fsd.target_quant import GROUP, Int4Product, Rounding, RowQuantLinear, own_product
from eagle_fsd.tree.accept import Step
from eagle_fsd.tree.dynamic import DraftTree, chain_tree, grow_pool, select_tree
from eagle_fsd.tree.shape import TreeShape

DRAFTING = ModelRun(exact=False)  # a drafter's run until the loader plans it


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
        bias = self.lm_head.bias
        self.bias = None if bias is None else bias.detach()[ids].contiguous()
        self.packed = pack_weight(self.weight) if isinstance(self.lm_head, PackedLinear) else None
        bits = self.lm_head.bits if isinstance(self.lm_head, QuantLinear) else 0
        self.quant = None
        if isinstance(self.lm_head, RowQuantLinear):  # a quantized head: its rows, rounded as the head rounds them
            product = own_product(self.lm_head.product)
            int4 = isinstance(product, Int4Product)
            rounding = Rounding(self.lm_head.activation_bits, product.per_row, int4, int4,
                                int4_group=product.group if int4 else GROUP)
            self.quant = RowQuantLinear.from_weight(self.weight, self.bias, rounding=rounding)
        elif bits == 8 or (bits == 4 and int4_fits(*self.weight.shape)):
            self.quant = QuantLinear.from_weight(self.weight, self.bias, bits)
            self.quant.packed = pack_weight(self.weight) if self.lm_head.packed is not None else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.draft_vocab is not None:
            if self.quant is not None:
                return self.quant(hidden)
            if self.packed is not None:
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
      is_decoder        its module is a transformers decoder (which eagle_fsd.fused_decoder may run)
      assistant_model   a causal LM HF assisted generation can draft with (None: none)"""

    feature_layers: tuple[int, ...] | None = None
    reads_features = True
    reducible_vocab = True
    auto_quant = False
    is_decoder = False
    assistant_model: nn.Module | None = None
    cache_layers = 1

    def __init__(self, draft_head, run: ModelRun = DRAFTING):
        self.draft_head = draft_head
        self.run = run  # how its forwards run (eagle_fsd.plan): the loader's plan, set once it is made
        self.cache, self.length = None, 0

    @property
    def module(self) -> nn.Module:
        """The drafter's own weights."""
        raise NotImplementedError

    def session(self, max_len: int, prompt: torch.Tensor, root: torch.Tensor, features: torch.Tensor) -> DraftSession:
        """A generate call's drafting from the prompt it decodes (read at the first draft)."""
        return DraftSession(self, max_len, prompt, root, features)

    @staticmethod
    def tree_room(shape: TreeShape) -> int:
        """Cache entries a verification forward appends past the committed tokens."""
        return shape.total_token + 1

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


class HeadDrafter(Drafter):
    """A drafter whose head reads the target's features: built for one target, in its dtype."""

    def __init__(self, head: nn.Module, target: nn.Module, draft_head, what: str):
        if head.fc.weight.dtype != target.dtype:
            raise ValueError(f"{what} dtype {head.fc.weight.dtype} != target dtype {target.dtype}; cast the head "
                             "with head.cast(target.dtype)")
        check_attention_support(target.config)
        super().__init__(draft_head)
        self.head, self.target = head, target

    @property
    def module(self) -> nn.Module:
        """The head's own weights (the target's embedding and lm_head are the target's)."""
        return self.head


class DraftSession:
    """One call's drafting. Where the drafter has read up to: its logits and state at the current root, and what it
    has not read yet: the prompt until the first draft (a call the speed guard decodes plainly throughout never runs
    the drafter), and the tokens decoded plainly since, with the target's hidden states (the guard skips drafting for
    a while)."""

    def __init__(self, drafter: Drafter, max_len: int, prompt: torch.Tensor, root: torch.Tensor,
                 hidden: torch.Tensor):
        self.drafter = drafter
        drafter.reset(max_len)
        self.unread_prompt: tuple | None = (prompt, root, hidden)
        self.root_logits = self.root_state = None
        self.behind: list[tuple[torch.Tensor, torch.Tensor]] = []

    def read_prompt(self) -> bool:
        """Read the prompt if not yet read (the first draft's prefill); True when it did."""
        if self.unread_prompt is None:
            return False
        self.root_logits, self.root_state = self.drafter.prefill(*self.unread_prompt)
        self.unread_prompt = None
        return True

    def draft(self, root: torch.Tensor, shape: TreeShape, speculate: bool) -> DraftTree:
        """The step's tree: grown from the root after the drafter caught up on what it missed (the prompt, the tokens
        decoded plainly), or the root alone where the step decodes plainly."""
        if not speculate:
            return chain_tree(root.reshape(1))
        self.read_prompt()
        if self.behind:
            self.root_logits, self.root_state = self.drafter.extend(torch.cat([t for t, _ in self.behind]),
                                                                    torch.cat([h for _, h in self.behind]))
            self.behind.clear()
        return grow_tree(self.drafter, root, self.root_logits, self.root_state, shape)

    def read(self, step: Step, features: torch.Tensor, tree: DraftTree, speculated: bool) -> None:
        """The step's emitted tokens and the target's features at them (`features` of the tree's nodes, read along
        the accepted path): read now, or queued for the next draft. A drafter that reads no features keeps the
        accepted chain's leading forwarded level entries (their scratch slots in the tree) and reads only the rest."""
        tokens = torch.tensor(step.tokens, device=features.device)
        hidden, path = features[step.path], step.path
        if not speculated:
            self.behind.append((tokens, hidden))
            return
        kept = 0
        if not self.drafter.reads_features:
            slots = tree.level_slots(path)
            kept = int((slots >= 0).cumprod(0).sum())
            self.drafter.keep_levels(slots[:kept])
        self.root_logits, self.root_state = self.drafter.extend(tokens[kept:], hidden[kept:])


class Plain:
    """Plain decoding as a proposer: each step's tree is the root alone, and there is nothing to read."""

    feature_layers = None

    def session(self, max_len: int, prompt: torch.Tensor, root: torch.Tensor, features: torch.Tensor) -> Plain:
        return self

    @staticmethod
    def tree_room(shape: TreeShape) -> int:
        return 1

    def read_prompt(self) -> bool:
        return False

    def draft(self, root: torch.Tensor, shape: TreeShape, speculate: bool) -> DraftTree:
        return chain_tree(root.reshape(1))

    def read(self, step, features, tree, speculated) -> None:
        pass


def grow_tree(drafter: Drafter, root_token, root_logits, root_state, shape: TreeShape) -> DraftTree:
    """EAGLE-2 drafting: `shape.depth` draft forwards of `shape.branching` nodes each, then the global rerank to
    `shape.total_token` nodes."""
    pool = grow_pool(drafter.forward_level, root_logits, root_state, shape.depth, shape.branching, drafter.draft_vocab)
    drafter.rollback()
    return select_tree(root_token, pool, shape.total_token, max_depth=shape.depth + 1)
