"""Acceptance on a draft tree: the lossless rule and the fuzzy (FSD) relaxation, as pure tensor functions.

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

Fuzzy rule (FSD) at a node n with children, with D_n = Div(p_n, q_n) -- one value per node, since all children of n
share n's context and hence one target and one draft distribution:
  reducible: run the lossless rule; if no child matches and D_n < T, accept the top-ranked child instead of
             stopping with the residual sample. T = 0 is exactly the lossless rule. T = inf accepts the top-ranked
             child whenever no child matches, whatever D_n is, +inf included (D < T read as "D is a number").
  original:  if D_n <= T accept the top-ranked child, whatever the target chose; else stop and emit the target's
             sample at n (no residual; for the paper's parity). T = inf accepts the top-ranked child always.
A NaN D_n (a node whose divergence was not computed) never accepts fuzzily, at any T.
The top-ranked child is the one with the highest draft score (EAGLE's first sibling, argmax q_n when it survived
pruning): FSD's premise is that when q_n is close to p_n, the draft's own best guess is an acceptable token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .dynamic import DraftTree

FSD_MODES = ("reducible", "original")


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
    path_is_prefix: bool = False  # path == 0..accept_length: the cache already holds it in place


def top_child(tree: DraftTree) -> torch.Tensor:
    """(n,) index of each node's top-ranked child, -1 for leaves.

    Siblings are stored in pool order, which is draft-rank order (top_k sorts them), so the first one is the best."""
    n = tree.size
    first = torch.full((n,), n, dtype=torch.long, device=tree.tokens.device)
    first.scatter_reduce_(0, tree.parents[1:], torch.arange(1, n, device=first.device), "amin")
    return torch.where(first < n, first, -1)


def fuzzy_choices(tree: DraftTree, target_choice: torch.Tensor, divergences: torch.Tensor, threshold: float,
                  mode: str = "reducible"):
    """Apply the FSD rule to the target's choices. Returns (choice, blocked): the choice to walk the tree with, and
    (original mode) nodes whose children are all rejected. NaN divergences never accept; at threshold = inf every
    other divergence does, +inf included (reducible: when no child matches; original: always)."""
    child = top_child(tree)
    has_child = child >= 0
    top_token = tree.tokens[child.clamp(min=0)]
    if mode == "reducible":
        parents = tree.parents[1:]
        child_matches = (tree.tokens[1:] == target_choice[parents]).long()
        matched = torch.zeros_like(child).scatter_reduce_(0, parents, child_matches, "amax").bool()
        # D < T, except that T = inf admits D = +inf too: every D but NaN. Compared in float64: a T beyond float32's
        # range would round to inf against float32 divergences.
        close = ~divergences.isnan() if threshold == math.inf else divergences.double() < threshold
        fuzzy = has_child & ~matched & close
        return torch.where(fuzzy, top_token, target_choice), None
    if mode == "original":
        take = has_child & (divergences.double() <= threshold)  # +inf <= inf holds; NaN <= T never does
        return torch.where(take, top_token, target_choice), ~take
    raise ValueError(f"fsd_mode={mode!r} is not one of {FSD_MODES}")


def accept(tree: DraftTree, choice: torch.Tensor, blocked: torch.Tensor | None = None,
           target_choice: torch.Tensor | None = None, divergences: torch.Tensor | None = None) -> Step:
    """Walk the tree against `choice` (the target's choices, possibly relaxed by `fuzzy_choices`).

    target_choice: the unrelaxed choices, to count fuzzy accepts (defaults to `choice`: none are fuzzy).
    One host sync per call: everything the caller needs on the host travels in one transfer.
    """
    if tree.size == 1:  # a root alone (plain decoding): its choice is the next token
        return Step(path=tree.depths.new_zeros(1), next_token=choice[0], accept_length=0, tokens=[int(choice[0])],
                    fuzzy=0, divergences=[float("nan")], fuzzy_mask=[False], path_is_prefix=True)
    parents = tree.parents.clamp(min=0)
    matches_parent = tree.tokens == choice[parents]
    if blocked is not None:
        matches_parent &= ~blocked[parents]
    matches_parent[0] = True
    # Accepted iff every node on the root path matches its parent's choice; -1 padding counts as a match.
    padded = torch.cat([matches_parent, matches_parent.new_ones(1)])
    accepted = padded[tree.ancestors].all(dim=1)
    deepest = torch.where(accepted, tree.depths, -1).argmax()
    width = tree.ancestors.shape[1]
    path = tree.ancestors[deepest]  # (width,), -1 after the deepest node
    on_path = path >= 0
    node = path.clamp(min=0)
    unrelaxed = choice if target_choice is None else target_choice
    is_fuzzy = on_path & (node > 0) & (tree.tokens[node] != unrelaxed[parents[node]])
    if divergences is None:
        path_div = torch.full((width,), float("nan"), device=path.device)
    else:
        path_div = torch.where(on_path & (top_child(tree)[node] >= 0), divergences[node].float(), float("nan"))
    host = torch.cat([tree.depths[deepest].reshape(1).double(), tree.tokens[node].double(),
                      choice[deepest].reshape(1).double(), is_fuzzy.double(), path_div.double(),
                      deepest.reshape(1).double()]).tolist()
    accept_length = int(host[0])
    tokens = [int(t) for t in host[2: 1 + accept_length + 1]] + [int(host[1 + width])]
    fuzzy_mask = [bool(f) for f in host[2 + width + 1: 2 + width + accept_length + 1]] + [False]
    path_divs = host[2 + 2 * width: 2 + 2 * width + accept_length + 1]
    return Step(path=path[: accept_length + 1], next_token=choice[deepest], accept_length=accept_length,
                tokens=tokens, fuzzy=sum(fuzzy_mask), divergences=path_divs, fuzzy_mask=fuzzy_mask,
                path_is_prefix=int(host[-1]) == accept_length)  # ascending node ids 0..a end at a only if 0..a


def acceptance_by_depth(accept_lengths: list[int]) -> list[float]:
    """[d-1] = P(a draft token at depth d is accepted | its parent was), pooled over steps with these accept lengths."""
    rates = []
    for d in range(1, max(accept_lengths, default=0) + 1):
        reached = sum(a >= d - 1 for a in accept_lengths)
        rates.append(sum(a >= d for a in accept_lengths) / reached)
    return rates
