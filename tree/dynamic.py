"""EAGLE-2 dynamic draft tree as pure tensor functions.

Drafting grows a *pool* level by level (EAGLE-2 §2): the root's top_k children form level 1; at every later level
the top_k pool nodes of the previous level with the best cumulative draft log-prob are expanded, each into its
top_k children. A node's value is the product of draft confidences along its path, i.e. the sum of log-probs.
The verified tree is the best `total_token - 1` pool nodes by value, plus the root. Because a child's value never
exceeds its parent's (log-probs are <= 0), that selection is closed under taking ancestors; a stable sort makes
ties pick the earlier (ancestor) pool node, so closure also holds when a log-prob rounds to exactly 0.

Pool indexing: pool index 0 is the root; non-root pool nodes are numbered 1.. in the order they were appended
(level-major), so a parent's pool index is always smaller than its children's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """One step's draft tree. Node 0 is the root; parents come before their children.

    tokens:           (n,) node tokens
    parents:          (n,) parent node index, -1 for the root
    depths:           (n,) distance from the root (root 0); verification position = committed length + depth
    ancestors:        (n, max_depth + 1) ancestors[i, d] = the ancestor of node i at depth d (-1 below node i)
    tree_mask:        (n, n) bool, True where node i may attend to node j (j is i or an ancestor of i)
    scores:           (n,) cumulative draft log-prob of the path to each node (root 0)
    dist_index:       (n,) row of `draft_logprobs` holding the draft distribution over node i's children, -1 if
                      node i was not expanded
    draft_logprobs:   (n_expanded, V) draft log-probs at the expanded nodes
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    tree_mask: torch.Tensor
    scores: torch.Tensor
    dist_index: torch.Tensor
    draft_logprobs: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def retrieve_indices(self) -> torch.Tensor:
        """(n_leaves, max_leaf_depth + 1): each row the root-to-leaf path as node indices, -1 padded (EAGLE's tensor)."""
        return retrieve_indices(self.parents, self.ancestors, self.depths)


def expand(parent_scores: torch.Tensor, child_logprobs: torch.Tensor, top_k: int):
    """Top_k children of each parent row: tokens (k_parents, top_k) and cumulative scores parent + log q(child)."""
    child_lp, child_tokens = child_logprobs.topk(top_k, dim=-1)
    return child_tokens, parent_scores[:, None] + child_lp


def choose_expansion(cumulative_scores: torch.Tensor, top_k: int):
    """Pick the top_k best children of a level (flattened (parents, k)) to expand next.

    Returns flat indices into the level's children, their parent rows and their scores.
    """
    scores, flat = cumulative_scores.flatten().topk(top_k)
    return flat, flat // cumulative_scores.shape[1], scores


def next_level_mask(level_mask: torch.Tensor, parent_rows: torch.Tensor) -> torch.Tensor:
    """Draft-side mask for the next level: each new node sees its parent's ancestors (earlier levels) and itself.

    level_mask (k, k * s) over the s levels drafted so far -> (k, k * (s + 1)).
    """
    k = parent_rows.numel()
    eye = torch.eye(k, dtype=torch.bool, device=level_mask.device)
    return torch.cat([level_mask[parent_rows], eye], dim=1)


def select_tree(
    root_token: torch.Tensor,
    pool_tokens: torch.Tensor,
    pool_scores: torch.Tensor,
    pool_parents: torch.Tensor,
    pool_depths: torch.Tensor,
    pool_dist_row: torch.Tensor,
    total_token: int,
    max_depth: int,
) -> DraftTree:
    """Global rerank: keep the best `total_token - 1` pool nodes (plus the root) and build the tree tensors.

    pool_* (P,) describe non-root pool nodes 1..P; pool_parents holds pool indices (0 = root).
    pool_dist_row (P + 1,) maps a pool index (root included) to its row of draft log-probs, -1 if not expanded.
    max_depth bounds pool_depths (the number of draft levels).
    """
    device = pool_tokens.device
    m = min(total_token - 1, pool_tokens.numel())
    order = torch.sort(pool_scores, descending=True, stable=True).indices[:m]
    chosen = torch.sort(order).values  # pool order = parents before children
    node_of_pool = torch.full((pool_tokens.numel() + 1,), -1, dtype=torch.long, device=device)
    node_of_pool[0] = 0
    node_of_pool[chosen + 1] = torch.arange(1, m + 1, device=device)

    zero = torch.zeros(1, dtype=torch.long, device=device)
    tokens = torch.cat([root_token.reshape(1).to(device), pool_tokens[chosen]])
    parents = torch.cat([zero - 1, node_of_pool[pool_parents[chosen]]])
    depths = torch.cat([zero, pool_depths[chosen]])
    scores = torch.cat([torch.zeros(1, dtype=pool_scores.dtype, device=device), pool_scores[chosen]])
    ancestors = ancestor_table(parents, depths, max_depth)
    return DraftTree(
        tokens=tokens,
        parents=parents,
        depths=depths,
        ancestors=ancestors,
        tree_mask=tree_mask_from_ancestors(ancestors, depths),
        scores=scores,
        dist_index=pool_dist_row[torch.cat([zero, chosen + 1])],
    )


def ancestor_table(parents: torch.Tensor, depths: torch.Tensor, max_depth: int) -> torch.Tensor:
    """ancestors[i, d] = ancestor of node i at depth d, -1 for d > depth(i). Pointer jumping, max_depth + 1 steps."""
    n = parents.numel()
    rows = torch.arange(n, device=parents.device)
    table = torch.full((n, max_depth + 1), -1, dtype=torch.long, device=parents.device)
    up = parents.clamp(min=0)  # the root is its own parent
    node = rows
    for _ in range(max_depth + 1):
        table[rows, depths[node]] = node
        node = up[node]
    return table


def tree_mask_from_ancestors(ancestors: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """tree_mask[i, j] = j is an ancestor of i or i itself  <=>  ancestors[i, depth(j)] == j."""
    n = depths.numel()
    cols = torch.arange(n, device=depths.device)
    return ancestors[:, depths] == cols[None, :]


def retrieve_indices(parents: torch.Tensor, ancestors: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """Root-to-leaf paths, one row per leaf (a node that is nobody's parent), -1 padded."""
    n = parents.numel()
    is_parent = torch.zeros(n, dtype=torch.bool, device=parents.device)
    is_parent[parents[parents >= 0]] = True
    leaves = (~is_parent).nonzero().flatten()
    return ancestors[leaves][:, : int(depths.max()) + 1]


def chain_tree(tokens: torch.Tensor) -> DraftTree:
    """A single chain root -> tokens[1] -> ... (used for prefill-free checks and plain decoding with n = 1)."""
    n = tokens.numel()
    idx = torch.arange(n, device=tokens.device)
    parents = idx - 1
    ancestors = ancestor_table(parents, idx, n - 1)
    return DraftTree(
        tokens=tokens, parents=parents, depths=idx, ancestors=ancestors,
        tree_mask=tree_mask_from_ancestors(ancestors, idx),
        scores=torch.zeros(n, device=tokens.device), dist_index=torch.full((n,), -1, device=tokens.device),
    )
