"""Fuzzy Speculative Decoding: its settings, the per-node divergences it thresholds, and its tree rule.

At a node n with children, with D_n = Div(p_n, q_n) -- one value per node, since all children of n share n's context
and hence one target and one draft distribution:
  reducible: run the lossless rule; if no child matches and D_n < T, accept the top-ranked child instead of
             stopping with the residual sample. T = 0 is exactly the lossless rule. T = inf accepts the top-ranked
             child whenever no child matches, whatever D_n is, +inf included (D < T read as "D is a number").
  original:  if D_n <= T accept the top-ranked child, whatever the target chose; else stop and emit the target's
             sample at n (no residual; for the paper's parity). T = inf accepts the top-ranked child always.
A NaN D_n (a node whose divergence was not computed) never accepts fuzzily, at any T.

Guards narrow where the rule may act (each an FsdConfig field, off by default; a guarded node keeps the lossless rule
in the reducible mode, and stops with the target's choice in the original mode, as a node with D_n above T does):
  keep_stop    where the target's own choice at n is a stop token (EOS, end of turn), no fuzzy acceptance: a reply
               does not run on past where the target would end it;
  top_r        the top-ranked child only if it is within the target's top r tokens at n;
  margin       the top-ranked child only if log p_n(child) >= max log p_n - margin (nats);
  min_entropy  only where the target's own entropy H(p_n) > h (nats): a confident target keeps its choice.
p_n here is the target's raw distribution (temperature 1, the tokenizer's vocabulary). T = 0 is lossless with any
guard.
The top-ranked child is the one with the highest draft score (EAGLE's first sibling, argmax q_n when it survived
pruning): FSD's premise is that when q_n is close to p_n, the draft's own best guess is an acceptable token.

The rule only relaxes the target's choices; tree/accept.py walks the tree with them (see there for why the lossless
walk is exact).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eagle_fsd.divergence import DIVERGENCES, align_vocab, divergence, kl_qp_on_support
from eagle_fsd.tree.accept import Step, accept, top_child
from eagle_fsd.tree.dynamic import DraftTree

DISTRIBUTIONS = ("raw", "processed")


def below_threshold(divergences: torch.Tensor, threshold: torch.Tensor | float) -> torch.Tensor:
    """D < T, except that T = inf admits D = +inf too: every D but NaN. threshold: T, or one T per divergence (a
    NaN T admits nothing: FSD off there). Compared in float64: a T beyond float32's range would round to inf
    against float32 divergences."""
    threshold = torch.as_tensor(threshold, dtype=torch.float64, device=divergences.device).expand(divergences.shape)
    return torch.where(threshold == math.inf, ~divergences.isnan(), divergences.double() < threshold)


def reducible_chain(accepted: torch.Tensor, divergences: torch.Tensor, threshold: torch.Tensor | float):
    """The reducible rule on a chain of drafts (each node has one child): draft i is kept when the lossless test
    kept it or D_i < T. accepted: (n,) bool, the lossless verdicts; divergences: (n,) D_i = Div(p_i, q_i), p_i and
    q_i the target's and the drafter's distributions at draft i's position. The chain ends at its first False."""
    return accepted | below_threshold(divergences, threshold)


def reducible_choices(tree: DraftTree, target_choice: torch.Tensor, divergences: torch.Tensor, threshold: float):
    """Lossless rule first; where no child matches and D < T, the top-ranked child instead. Nothing is blocked."""
    child = top_child(tree)
    parents = tree.parents[1:]
    child_matches = (tree.tokens[1:] == target_choice[parents]).long()
    matched = torch.zeros_like(child).scatter_reduce_(0, parents, child_matches, "amax").bool()
    fuzzy = (child >= 0) & ~matched & below_threshold(divergences, threshold)
    return torch.where(fuzzy, tree.tokens[child.clamp(min=0)], target_choice), None


def original_choices(tree: DraftTree, target_choice: torch.Tensor, divergences: torch.Tensor, threshold: float):
    """The paper's rule: where D <= T the top-ranked child, whatever the target chose; elsewhere every child is
    blocked (the step stops with the target's choice)."""
    child = top_child(tree)
    take = (child >= 0) & (divergences.double() <= threshold)  # +inf <= inf holds; NaN <= T never does
    return torch.where(take, tree.tokens[child.clamp(min=0)], target_choice), ~take


FUZZY_RULES = {"reducible": reducible_choices, "original": original_choices}
FSD_MODES = tuple(FUZZY_RULES)


@dataclass(frozen=True)
class FsdConfig:
    """threshold: T (None = FSD off, lossless). divergence: one of DIVERGENCES (natural log; jsd_bits in [0, 1]).
    mode: "reducible" (lossless rule first, T = 0 is exact) or "original" (the paper's code: D <= T accepts).
    T = math.inf: reducible accepts the top-ranked child wherever the lossless rule rejects every child, original
    accepts it at every node; any D counts there, +inf included (a reduced draft vocabulary, processed distributions),
    except NaN (no divergence computed), which never accepts.
    distributions: "raw" (temperature 1, full vocabulary; the paper's setting) or "processed" (after temperature /
    top-k / top-p). top_k: the divergence over the target's top-K tokens plus one rest bucket (None = full vocab).
    exact_prefix: the first L new tokens of each reply are verified losslessly (never fuzzy, at any T): lossy
    acceptance can weaken a reply's opening, where refusals and format decisions are made.
    Guards (module docstring): keep_stop, top_r (int >= 1), margin (nats >= 0), min_entropy (nats >= 0); None / False
    is off."""

    threshold: float | None = None
    divergence: str = "kl_qp"
    mode: str = "reducible"
    distributions: str = "raw"
    top_k: int | None = None
    exact_prefix: int = 0
    keep_stop: bool = False
    top_r: int | None = None
    margin: float | None = None
    min_entropy: float | None = None

    def __post_init__(self):
        t = self.threshold
        if t is not None and (not isinstance(t, (int, float)) or math.isnan(t) or t < 0):
            raise ValueError(f"fsd_threshold={t!r} must be a number >= 0 (None turns FSD off; 0 with the reducible "
                             "mode is lossless; math.inf accepts the top-ranked child wherever the mode allows, "
                             "whatever D is)")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"fsd_divergence={self.divergence!r} is not one of {DIVERGENCES}")
        if self.mode not in FSD_MODES:
            raise ValueError(f"fsd_mode={self.mode!r} is not one of {FSD_MODES}")
        if self.distributions not in DISTRIBUTIONS:
            raise ValueError(f"fsd_distributions={self.distributions!r} is not one of {DISTRIBUTIONS}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"fsd_top_k={self.top_k!r} must be a positive int or None (full vocabulary)")
        if not isinstance(self.exact_prefix, int) or self.exact_prefix < 0:
            raise ValueError(f"fsd_exact_prefix={self.exact_prefix!r} must be an int >= 0 (the number of new tokens "
                             "verified losslessly before FSD may accept; 0 = none)")
        if self.top_r is not None and (not isinstance(self.top_r, int) or isinstance(self.top_r, bool)
                                       or self.top_r < 1):
            raise ValueError(f"fsd_top_r={self.top_r!r} must be an int >= 1 (a fuzzy acceptance only for a draft "
                             "within the target's top r tokens) or None (off)")
        for name in ("margin", "min_entropy"):
            value = self.margin if name == "margin" else self.min_entropy
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or math.isnan(value) or value < 0):
                raise ValueError(f"fsd_{name}={value!r} must be a number of nats >= 0, or None (off)")

    @property
    def guarded(self) -> bool:
        """Some guard narrows where the rule acts."""
        return self.keep_stop or self.top_r is not None or self.margin is not None or self.min_entropy is not None

    @property
    def active(self) -> bool:
        return self.threshold is not None


def resolve_fsd(fsd: FsdConfig | None, fsd_threshold: float | None) -> FsdConfig:
    """generate's two spellings: a whole FsdConfig, or fsd_threshold=T as the shortcut for FsdConfig(threshold=T)."""
    if fsd is not None and fsd_threshold is not None:
        raise ValueError(f"pass either fsd=FsdConfig(...) or fsd_threshold={fsd_threshold!r}, not both (put the "
                         "threshold in the FsdConfig)")
    return fsd if fsd is not None else FsdConfig(threshold=fsd_threshold)


def fuzzy_choices(tree: DraftTree, target_choice: torch.Tensor, divergences: torch.Tensor, threshold: float,
                  mode: str = "reducible"):
    """Apply the FSD rule of `mode` (one of FSD_MODES, checked by FsdConfig) to the target's choices. Returns
    (choice, blocked): the choice to walk the tree with, and (original mode) nodes whose children are all rejected."""
    return FUZZY_RULES[mode](tree, target_choice, divergences, threshold)


def node_divergences(tree: DraftTree, target_logits: torch.Tensor, fsd: FsdConfig, vocab_size: int,
                     processor=None) -> torch.Tensor:
    """(n,) D_n = Div(p_n, q_n) for every expanded node, NaN for the others (never accepted fuzzily).

    Both distributions are cut to the tokenizer's `vocab_size`: logit rows padded beyond it are not tokens. With a
    reduced draft vocabulary q is 0 outside it, so KL(p||q) (kl_pq) and legacy_js are +inf wherever p has mass
    there (no fuzzy accept at a finite T; T = inf accepts any D but NaN); kl_qp, jsd and tv stay finite, and kl_qp
    (raw distributions, full vocabulary) reads only p's log-normaliser and its draft-vocabulary columns."""
    nodes = (tree.dist_index >= 0).nonzero()[:, 0]
    out = torch.full((tree.size,), math.nan, device=target_logits.device)
    if nodes.numel() == 0:
        return out
    rows = tree.dist_index[nodes]
    target = target_logits[nodes]
    if tree.draft_vocab is not None and fsd.divergence == "kl_qp" and fsd.distributions == "raw" and fsd.top_k is None:
        inside = tree.draft_vocab < vocab_size
        div = kl_qp_on_support(target[:, :vocab_size], tree.draft_logits[rows][:, inside], tree.draft_vocab[inside])
        return out.index_put_((nodes,), div)
    draft = tree.draft_logprobs_over(target_logits.shape[-1])[rows]
    target, draft = align_vocab(target.float(), draft, vocab_size)
    if fsd.distributions == "processed" and processor is not None:
        target, draft = processor(None, target), processor(None, draft.clone())
    if fsd.top_k is None and target.is_cuda:
        from eagle_fsd.kernels import FUSED_DIVERGENCES, fused_divergence

        if fsd.divergence in FUSED_DIVERGENCES:
            return out.index_put_((nodes,), fused_divergence(target, draft, fsd.divergence))
    return out.index_put_((nodes,), divergence(target, draft, fsd.divergence, top_k=fsd.top_k))


def fuzzy_allowed(target_logits: torch.Tensor, candidates: torch.Tensor, target_choice: torch.Tensor, fsd: FsdConfig,
                  vocab_size: int, stop_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(n,) bool: where FsdConfig's guards let a fuzzy acceptance happen (all True with no guard on). Row i: the
    target's logits (V,) at a position, the candidate token the rule would accept there (a node's top-ranked child,
    a chain's draft; -1: none) and the target's own choice; stop_ids: the stop tokens (keep_stop)."""
    allowed = torch.ones(candidates.shape, dtype=torch.bool, device=candidates.device)
    if fsd.keep_stop and stop_ids is not None and stop_ids.numel():
        allowed &= ~torch.isin(target_choice, stop_ids.to(target_choice.device))
    if fsd.top_r is None and fsd.margin is None and fsd.min_entropy is None:
        return allowed
    logits = target_logits[:, :vocab_size].float().contiguous()
    if fsd.min_entropy is not None:  # H(p) = -sum p log p, with 0 log 0 = 0
        allowed &= torch.special.entr(torch.softmax(logits, dim=-1)).sum(-1) > fsd.min_entropy
    if fsd.top_r is not None or fsd.margin is not None:
        # ranks and log p(x) - max log p are read off the logits: the log-normaliser cancels in both
        inside = (candidates >= 0) & (candidates < vocab_size)
        chosen = logits.gather(1, candidates.clamp(0, vocab_size - 1)[:, None])[:, 0]
        if fsd.top_r is not None:  # rank = how many tokens the target prefers strictly
            allowed &= inside & ((logits > chosen[:, None]).sum(-1) < fsd.top_r)
        if fsd.margin is not None:
            allowed &= inside & (chosen >= logits.max(-1).values - fsd.margin)
    return allowed


def guarded_divergences(tree: DraftTree, target_logits: torch.Tensor, target_choice: torch.Tensor,
                        divergences: torch.Tensor, fsd: FsdConfig, vocab_size: int,
                        stop_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The divergences the rule reads: NaN (never fuzzy) at nodes a guard closes."""
    if not fsd.guarded:
        return divergences
    child = top_child(tree)
    candidates = torch.where(child >= 0, tree.tokens[child.clamp(min=0)], -1)
    allowed = fuzzy_allowed(target_logits, candidates, target_choice, fsd, vocab_size, stop_ids)
    return torch.where(allowed, divergences, math.nan)


def exact_depth(fsd: FsdConfig, emitted: int) -> int:
    """Nodes shallower than this keep the lossless rule. The root is the reply's token emitted - 1, so a child of a
    node at depth d becomes token emitted + d; it must be exact while emitted + d < exact_prefix."""
    return max(fsd.exact_prefix - emitted, 0)


def keep_exact(tree: DraftTree, target_choice: torch.Tensor, choice: torch.Tensor, blocked: torch.Tensor | None,
               depth: int):
    """The FSD choices with the lossless ones restored at nodes shallower than `depth` (exact prefix guard)."""
    exact = tree.depths < depth
    choice = torch.where(exact, target_choice, choice)
    return choice, (None if blocked is None else blocked & ~exact)


def fsd_accept(tree: DraftTree, target_logits: torch.Tensor, target_choice: torch.Tensor, fsd: FsdConfig | None,
               vocab_size: int, processor=None, emitted: int = 0, stop_ids: torch.Tensor | None = None) -> Step:
    """One verification step's acceptance: the lossless walk, relaxed by the FSD rule when FSD is on.
    emitted: new tokens of this reply before the step's tree (its root included), for FsdConfig.exact_prefix;
    stop_ids: the reply's stop tokens, for FsdConfig.keep_stop. The step records the divergences as computed (a
    guard's closing of a node is not a divergence)."""
    if fsd is None or not fsd.active or tree.size == 1:
        return accept(tree, target_choice)
    exact = exact_depth(fsd, emitted)
    if exact >= tree.ancestors.shape[1] - 1:  # every parent in the tree is inside the exact prefix
        return accept(tree, target_choice)
    divergences = node_divergences(tree, target_logits, fsd, vocab_size, processor)
    ruled = guarded_divergences(tree, target_logits, target_choice, divergences, fsd, vocab_size, stop_ids)
    choice, blocked = fuzzy_choices(tree, target_choice, ruled, fsd.threshold, fsd.mode)
    if exact:
        choice, blocked = keep_exact(tree, target_choice, choice, blocked, exact)
    return accept(tree, choice, blocked, target_choice, divergences)
