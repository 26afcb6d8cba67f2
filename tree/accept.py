"""Acceptance on a draft tree: the lossless walk, as pure tensor functions.

Every tree node n carries the target's verdict `target_choice[n]`: the token the target emits after the context
"prefix + path(n)" -- its argmax (greedy) or one sample from its processed distribution p_n (sampling).

Lossless rule: a node is accepted when its token equals its parent's choice and its parent is accepted (the root
always is). The deepest accepted node b ends the step and choice[b] is the next token.

Why this is lossless. Greedy: the accepted path is exactly what greedy decoding would produce. Sampling: the
draft proposes deterministic top-k children (a point mass per child, q = 1 as in EAGLE-2), so EAGLE-2's sibling
rule -- accept child c_i with probability p'(c_i), on rejection zero c_i in p' and renormalise -- accepts c_i with
probability p(c_i) and, after rejecting all children, samples from p restricted to the other tokens. That is the
same law as drawing one x ~ p_n and descending into the child whose token is x, or stopping with x when no child
matches. So each emitted token is an exact sample from the target's processed distribution at its context.
Children of one node are distinct tokens, so at most one child matches and the accepted nodes form one path.

The walk takes the choices as given: Fuzzy Speculative Decoding (eagle_fsd/fsd.py) relaxes them before the walk
(a `choice` that differs from `target_choice`, and `blocked` nodes whose children are all rejected) and passes the
per-node divergences it thresholded, which the walk only reports.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .dynamic import DraftTree


@dataclass
class Step:
    """What one verification step decided."""

    path: torch.Tensor        # (accept_length + 1,) node indices root..b of the accepted path (device)
    next_token: torch.Tensor  # () the token after b: bonus (b has no children) or correction; next step's root
    accept_length: int        # accepted draft tokens
    tokens: list[int]         # emitted this step: the accepted draft tokens, then next_token
    fuzzy: int                # accepted draft tokens the lossless rule would have rejected
    divergences: list[float]  # D at each node on the path that has children (NaN where not computed)
    fuzzy_mask: list[bool]    # per emitted token: accepted only by the FSD rule (next_token never is)


class PathSummary(NamedTuple):
    """What the host needs of the deepest accepted path; `width` = the tree's depth + 1, entries past b are junk."""

    deepest: torch.Tensor      # () node index of b
    depth: torch.Tensor        # () depth of b = accepted draft tokens
    tokens: torch.Tensor       # (width,) token of each path node, root first
    next_token: torch.Tensor   # () choice[b]
    fuzzy: torch.Tensor        # (width,) path node accepted only because its parent's choice was relaxed
    divergences: torch.Tensor  # (width,) D at each path node with children, NaN elsewhere


def to_host(fields: NamedTuple) -> NamedTuple:
    """The same fields as float64 CPU tensors, in one device-to-host transfer (float64 holds token ids exactly)."""
    flat = torch.cat([f.double().reshape(-1) for f in fields]).cpu()
    parts = flat.split([f.numel() for f in fields])
    return type(fields)._make(part.reshape(f.shape) for part, f in zip(parts, fields))


def tokens_per_step(accepted_tokens: int, steps: int) -> float:
    """tau = (accepted draft tokens + one target token per step) / steps; NaN when there was no step."""
    return (accepted_tokens + steps) / steps if steps else math.nan


def top_child(tree: DraftTree) -> torch.Tensor:
    """(n,) index of each node's top-ranked child, -1 for leaves.

    Siblings are stored in pool order, which is draft-rank order (top_k sorts them), so the first one is the best."""
    n = tree.size
    first = torch.full((n,), n, dtype=torch.long, device=tree.tokens.device)
    first.scatter_reduce_(0, tree.parents[1:], torch.arange(1, n, device=first.device), "amin")
    return torch.where(first < n, first, -1)


def accepted_mask(tree: DraftTree, choice: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
    """(n,) bool: every node on the root path matches its parent's choice, no ancestor is blocked."""
    parents = tree.parents.clamp(min=0)
    matches_parent = tree.tokens == choice[parents]
    if blocked is not None:
        matches_parent &= ~blocked[parents]
    matches_parent[0] = True
    padded = torch.cat([matches_parent, matches_parent.new_ones(1)])  # -1 padding of `ancestors` counts as a match
    return padded[tree.ancestors].all(dim=1)


def summarise_path(tree: DraftTree, choice: torch.Tensor, accepted: torch.Tensor, unrelaxed: torch.Tensor,
                   divergences: torch.Tensor | None) -> PathSummary:
    """The deepest accepted node b and its root path, as device tensors (no host sync)."""
    deepest = torch.where(accepted, tree.depths, -1).argmax()
    path = tree.ancestors[deepest]  # (width,), -1 after b
    on_path = path >= 0
    node = path.clamp(min=0)
    fuzzy = on_path & (node > 0) & (tree.tokens[node] != unrelaxed[tree.parents.clamp(min=0)[node]])
    if divergences is None:
        path_div = torch.full(path.shape, math.nan, device=path.device)
    else:
        path_div = torch.where(on_path & (top_child(tree)[node] >= 0), divergences[node].float(), math.nan)
    return PathSummary(deepest, tree.depths[deepest], tree.tokens[node], choice[deepest], fuzzy, path_div)


def accept(tree: DraftTree, choice: torch.Tensor, blocked: torch.Tensor | None = None,
           target_choice: torch.Tensor | None = None, divergences: torch.Tensor | None = None) -> Step:
    """Walk the tree against `choice` (the target's choices, possibly relaxed by FSD; `blocked` nodes accept no
    child). target_choice: the unrelaxed choices, to count fuzzy accepts (defaults to `choice`: none are fuzzy).
    divergences: (n,) per-node D, reported along the path. One host sync per call."""
    if tree.size == 1:  # a root alone (plain decoding): its choice is the next token
        return Step(path=tree.depths.new_zeros(1), next_token=choice[0], accept_length=0, tokens=[int(choice[0])],
                    fuzzy=0, divergences=[math.nan], fuzzy_mask=[False])
    unrelaxed = choice if target_choice is None else target_choice
    summary = summarise_path(tree, choice, accepted_mask(tree, choice, blocked), unrelaxed, divergences)
    host = to_host(summary)
    a = int(host.depth)
    tokens = [int(t) for t in host.tokens[1: a + 1].tolist()] + [int(host.next_token)]
    fuzzy_mask = [bool(f) for f in host.fuzzy[1: a + 1].tolist()] + [False]
    return Step(path=tree.ancestors[summary.deepest][: a + 1], next_token=summary.next_token, accept_length=a,
                tokens=tokens, fuzzy=sum(fuzzy_mask), divergences=host.divergences[: a + 1].tolist(),
                fuzzy_mask=fuzzy_mask)


def acceptance_by_depth(accept_lengths: list[int]) -> list[float]:
    """[d-1] = P(a draft token at depth d is accepted | its parent was), pooled over steps with these accept lengths."""
    rates = []
    for d in range(1, max(accept_lengths, default=0) + 1):
        reached = sum(a >= d - 1 for a in accept_lengths)
        rates.append(sum(a >= d for a in accept_lengths) / reached)
    return rates
