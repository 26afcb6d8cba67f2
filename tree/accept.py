"""Lossless acceptance on a draft tree.

Every tree node n carries the target's verdict `target_choice[n]`: the token the target emits after the context
"prefix + path(n)" -- its argmax (greedy) or one sample from its processed distribution p_n (sampling).

Rule: a node is accepted when its token equals its parent's target_choice and its parent is accepted (the root
always is). The deepest accepted node b ends the step and target_choice[b] is the next token.

Why this is lossless. Greedy: the accepted path is exactly what greedy decoding would produce. Sampling: the
draft proposes deterministic top-k children (a point mass per child, q = 1 as in EAGLE-2), so EAGLE-2's sibling
rule -- accept child c_i with probability p'(c_i), on rejection zero c_i in p' and renormalise -- accepts c_i with
probability p(c_i) and, after rejecting all children, samples from p restricted to the other tokens. That is the
same law as drawing one x ~ p_n and descending into the child whose token is x, or stopping with x when no child
matches. So each emitted token is an exact sample from the target's processed distribution at its context.
Children of one node are distinct tokens, so at most one child matches and the accepted nodes form one path.
"""
from __future__ import annotations

import torch

from .dynamic import DraftTree


def accepted_nodes(tree: DraftTree, target_choice: torch.Tensor) -> torch.Tensor:
    """(n,) bool: node is on the accepted path."""
    matches_parent = tree.tokens == target_choice[tree.parents.clamp(min=0)]
    matches_parent[0] = True
    # A node is accepted iff every node on its root path matches its parent's choice; -1 padding counts as a match.
    padded = torch.cat([matches_parent, matches_parent.new_ones(1)])
    return padded[tree.ancestors].all(dim=1)


def accept(tree: DraftTree, target_choice: torch.Tensor):
    """Walk the tree against the target's choices.

    Returns (path, accept_length, next_token): path = node indices root..b of the accepted path (accept_length + 1
    of them), accept_length = number of accepted draft tokens, next_token = target_choice[b] (the bonus token when
    b is a leaf or the depth limit, the correction token otherwise). One host sync (the path length).
    """
    accepted = accepted_nodes(tree, target_choice)
    deepest = torch.where(accepted, tree.depths, -1).argmax()
    accept_length = int(tree.depths[deepest])
    path = tree.ancestors[deepest, : accept_length + 1]
    return path, accept_length, target_choice[deepest]
