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

from eagle_fsd.kernels import decoder_glue


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
    draft_logits:     (n_expanded, V_draft) raw draft logits at the expanded nodes
    draft_vocab:      (V_draft,) target ids of the draft vocabulary columns (None: the full vocabulary)
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    tree_mask: torch.Tensor
    scores: torch.Tensor
    dist_index: torch.Tensor
    draft_logits: torch.Tensor | None = None
    draft_vocab: torch.Tensor | None = None

    def draft_logprobs_over(self, vocab_size: int) -> torch.Tensor:
        """(n_expanded, vocab_size) fp32 draft log-probs over the target vocabulary: log q = -inf outside a reduced
        draft vocabulary (q is 0 there)."""
        logprobs = torch.log_softmax(self.draft_logits.float(), dim=-1)
        if self.draft_vocab is None:
            return logprobs
        full = logprobs.new_full((logprobs.shape[0], vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_vocab, logprobs)

    def level_slots(self, path: torch.Tensor) -> torch.Tensor:
        """For each draft node of an accepted path (path[1:]), the row of the level forwards that expanded it, in
        the order the drafter appended them (level L's j-th node at L * top_k + j): dist_index - 1, negative for a
        node no level forward read."""
        return self.dist_index[path[1:]] - 1

    @property
    def draft_logprobs(self) -> torch.Tensor:
        """Draft log-probs over the draft model's logit width (the target vocabulary when not reduced)."""
        if self.draft_vocab is not None:
            raise ValueError("a reduced draft vocabulary: use draft_logprobs_over(vocab_size)")
        return torch.log_softmax(self.draft_logits.float(), dim=-1)

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def retrieve_indices(self) -> torch.Tensor:
        """(n_leaves, max_leaf_depth + 1): each row the root-to-leaf path as node indices, -1 padded (EAGLE's tensor)."""
        return retrieve_indices(self.parents, self.ancestors, self.depths)


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


@dataclass
class DraftPool:
    """Every node drafted in one step, before the global rerank, in pool indexing (module docstring): the nodes of
    the first d levels are a prefix of the pool.

    tokens, scores, parents, depths: (P,) token, cumulative draft log-prob, parent pool index (0 = root), level
    dist_row:     (P + 1,) row of `draft_logits` holding the draft distribution over a pool node's children (root
                  included), -1 if the node was not expanded
    draft_logits, draft_vocab: as in DraftTree (the trees selected from this pool share them)
    """

    tokens: torch.Tensor
    scores: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    dist_row: torch.Tensor
    draft_logits: torch.Tensor | None = None
    draft_vocab: torch.Tensor | None = None

    def first_levels(self, levels: int) -> "DraftPool":
        """The pool a `levels`-deep drafting with the same top_k would have grown (a prefix of this one)."""
        n = int((self.depths <= levels).sum())
        return DraftPool(self.tokens[:n], self.scores[:n], self.parents[:n], self.depths[:n], self.dist_row[: n + 1],
                         self.draft_logits, self.draft_vocab)


def top_logprobs(logits: torch.Tensor, top_k: int, draft_vocab: torch.Tensor | None = None):
    """Top_k draft log-probs and their target token ids per row: log q = logit - logsumexp(logits), computed for
    the top_k only (the full log_softmax is never materialised); on a CPU in one C++ pass per row, where torch's topk
    and logsumexp cost a few tenths of a ms each over a 152k vocabulary, at the root and at every draft level."""
    if logits.device.type == "cpu" and decoder_glue.decoder_glue_available():
        logprobs, columns = decoder_glue.top_logprobs(logits.float().contiguous(), top_k)
    else:
        values, columns = logits.topk(top_k, dim=-1)
        logprobs = values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    tokens = columns if draft_vocab is None else draft_vocab[columns]
    return logprobs, tokens


def grow_pool(forward_level, root_logits: torch.Tensor, root_state, depth: int, branching: int,
              draft_vocab: torch.Tensor | None = None) -> DraftPool:
    """EAGLE-2 drafting: the root's `branching` best children, then `depth` draft forwards, each over the
    `branching` nodes of the newest level with the best cumulative log-prob, adding their `branching` best children
    (EAGLE's top_k).

    forward_level(tokens (k,), parent_states, level, level_mask (k, k * (level + 1))) -> (logits (k, V_draft),
    states): one draft forward over a level's nodes, each seeing its ancestors of earlier levels and itself."""
    device = root_logits.device
    k = branching
    root_lp, root_tokens = top_logprobs(root_logits[None], k, draft_vocab)
    frontier_tokens, frontier_scores = root_tokens[0], root_lp[0]
    frontier_pool = torch.arange(1, k + 1, device=device)
    frontier_state = None if root_state is None else root_state[None].expand(k, -1)
    level_mask = torch.eye(k, dtype=torch.bool, device=device)

    tokens, scores = [frontier_tokens], [frontier_scores]
    parents = [torch.zeros(k, dtype=torch.long, device=device)]
    depths = [torch.ones(k, dtype=torch.long, device=device)]
    dist_row = torch.full((1 + k + depth * k * k,), -1, dtype=torch.long, device=device)
    dist_row[0] = 0
    logit_rows = [root_logits[None]]
    n_pool = k
    for level in range(depth):
        logits, states = forward_level(frontier_tokens, frontier_state, level, level_mask)
        dist_row[frontier_pool] = torch.arange(1 + level * k, 1 + (level + 1) * k, device=device)
        logit_rows.append(logits)
        child_lp, child_tokens = top_logprobs(logits, k, draft_vocab)
        child_scores = frontier_scores[:, None] + child_lp
        tokens.append(child_tokens.flatten())
        scores.append(child_scores.flatten())
        parents.append(frontier_pool.repeat_interleave(k))
        depths.append(torch.full((k * k,), level + 2, dtype=torch.long, device=device))
        child_pool = n_pool + 1 + torch.arange(k * k, device=device)
        n_pool += k * k
        if level + 1 < depth:
            flat, rows, frontier_scores = choose_expansion(child_scores, k)
            frontier_pool, frontier_tokens = child_pool[flat], child_tokens.flatten()[flat]
            frontier_state = None if states is None else states[rows]
            level_mask = next_level_mask(level_mask, rows)
    return DraftPool(torch.cat(tokens), torch.cat(scores), torch.cat(parents), torch.cat(depths),
                     dist_row[: n_pool + 1], torch.cat(logit_rows), draft_vocab)


def select_tree(root_token: torch.Tensor, pool: DraftPool, total_token: int, max_depth: int | None = None) -> DraftTree:
    """Global rerank: keep the best `total_token - 1` pool nodes (plus the root) and build the tree tensors.

    max_depth bounds pool.depths (default: the deepest pool level)."""
    device = pool.tokens.device
    if max_depth is None:
        max_depth = int(pool.depths.max()) if pool.depths.numel() else 0
    m = min(total_token - 1, pool.tokens.numel())
    order = torch.sort(pool.scores, descending=True, stable=True).indices[:m]
    chosen = torch.sort(order).values  # pool order = parents before children
    node_of_pool = torch.full((pool.tokens.numel() + 1,), -1, dtype=torch.long, device=device)
    node_of_pool[0] = 0
    node_of_pool[chosen + 1] = torch.arange(1, m + 1, device=device)

    zero = torch.zeros(1, dtype=torch.long, device=device)
    tokens = torch.cat([root_token.reshape(1).to(device), pool.tokens[chosen]])
    parents = torch.cat([zero - 1, node_of_pool[pool.parents[chosen]]])
    depths = torch.cat([zero, pool.depths[chosen]])
    scores = torch.cat([torch.zeros(1, dtype=pool.scores.dtype, device=device), pool.scores[chosen]])
    ancestors = ancestor_table(parents, depths, max_depth)
    return DraftTree(
        tokens=tokens,
        parents=parents,
        depths=depths,
        ancestors=ancestors,
        tree_mask=tree_mask_from_ancestors(ancestors, depths),
        scores=scores,
        dist_index=pool.dist_row[torch.cat([zero, chosen + 1])],
        draft_logits=pool.draft_logits,
        draft_vocab=pool.draft_vocab,
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
