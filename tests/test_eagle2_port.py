"""The engine's EAGLE-2 tree against an independent port of EAGLE-2's tree construction.

The port below is written from the published algorithm (EAGLE-2, arXiv 2406.16858, §4 "context-aware dynamic draft
tree", and the reference implementation's `topK_genrate` as described there), in plain Python over lists, sharing no
code with `eagle_fsd.tree.dynamic`:

  expansion  The root's top_k tokens under log q(. | root) form level 1. Then `depth` rounds, one draft forward each:
             the top_k nodes of the newest level by value (all top_k at the first round) are expanded, each into its
             top_k tokens under log q(. | its path). A node's value is its cumulative draft log-prob, the sum of
             log q along its path (the product of confidences, in logs).
  reranking  All drafted nodes by value; the best total_token - 1 are kept (all of them when there are fewer),
             in drafting order, plus the root. A parent's value exceeds its children's (log q < 0), so every kept
             node's parent is kept.
  tree mask  Row i: node i itself, the root, and its parent's row (parents come first in drafting order; the parent's
             row is found by binary search over the kept drafting indices, as EAGLE's searchsorted does). The
             position of a node is its row sum - 1, its depth.

Drafter outputs are continuous random logits, a deterministic function of the path they condition on, so both
builders see the same drafter; cases whose decisions are within float32 rounding of a tie are redrawn (counted).
"""
from __future__ import annotations

import bisect
import math
import zlib
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from eagle_fsd.tree.dynamic import grow_pool, select_tree

VOCAB = 48
ROOT = 7
TIE_MARGIN = 1e-4  # value gaps below this could be decided differently by float32 (engine) and float64 (port)


# ----------------------------------------------------------------------------- the drafter both builders query
def drafter_logits(seed: int, path: tuple[int, ...], width: int) -> torch.Tensor:
    """(width,) fp32 logits of the draft distribution after `path` (root token first): N(0, 2^2) per entry, seeded
    by the case and the path, so the same path always gets the same distribution."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((seed, path)).encode()))
    return (2.0 * torch.randn(width, generator=gen, dtype=torch.float64)).float()


def log_softmax(logits: list[float]) -> list[float]:
    """log q_i = x_i - log sum_j exp(x_j), with the max subtracted first for stability."""
    top = max(logits)
    log_norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - log_norm for x in logits]


# ----------------------------------------------------------------------------- the port
@dataclass
class PortTree:
    paths: list[tuple[int, ...]]   # root path of every kept node, node 0 the root (a path of its token alone)
    parents: list[int]             # -1 for the root
    values: list[float]            # cumulative draft log-prob, 0 for the root
    mask: list[list[bool]]         # EAGLE's tree mask
    positions: list[int]           # EAGLE's tree_position_ids
    expanded: set[tuple[int, ...]]  # paths whose draft distribution was computed (the root and the frontiers)
    frontiers: list[list[tuple[int, ...]]]  # paths fed to each draft forward, in order
    margin: float                  # smallest value gap at a top-k decision (frontier choice and rerank cut)


def eagle2_tree(logits_of, total_token: int, depth: int, top_k: int, draft_vocab: list[int] | None) -> PortTree:
    """EAGLE-2's dynamic draft tree for the drafter `logits_of(path) -> logits over the draft vocabulary`."""
    token_of = (lambda column: column) if draft_vocab is None else (lambda column: draft_vocab[column])
    drafted = []  # (path, drafting index of the parent or -1 for the root, value), in drafting order
    margin = math.inf

    def best(items, key, k):
        """The k items with the largest key, best first; also the gap between the k-th and the next."""
        ranked = sorted(items, key=key, reverse=True)
        gap = key(ranked[k - 1]) - key(ranked[k]) if len(ranked) > k else math.inf
        return ranked[:k], gap

    def expand(parent_index, path, value):
        """The top_k children of the node at `path`: (path + token, parent, value + log q(token | path))."""
        logq = log_softmax(logits_of(path).double().tolist())
        # log q is increasing in the logit, so this ranks the (distinct) logits themselves: no near-tie to guard
        columns, _ = best(range(len(logq)), lambda c: logq[c], top_k)
        return [(path + (token_of(c),), parent_index, value + logq[c]) for c in columns]

    drafted += expand(-1, (ROOT,), 0.0)  # level 1
    expanded, frontiers = {(ROOT,)}, []
    frontier = list(range(len(drafted)))  # round 1 expands every root child
    for round_ in range(depth):
        frontiers.append([drafted[i][0] for i in frontier])
        new_level = []
        for i in frontier:
            path, _, value = drafted[i]
            expanded.add(path)
            new_level += expand(i, path, value)
        first = len(drafted)  # drafting index of the newest level's first node
        drafted += new_level
        if round_ + 1 < depth:  # the next round expands the newest level's top_k nodes by value
            frontier, gap = best(range(first, len(drafted)), lambda i: drafted[i][2], top_k)
            margin = min(margin, gap)

    keep = min(total_token - 1, len(drafted))
    kept, gap = best(range(len(drafted)), lambda i: drafted[i][2], keep)
    margin = min(margin, gap)
    kept.sort()  # back to drafting order: parents before children
    paths, parents, values = [(ROOT,)], [-1], [0.0]
    mask = [[True]]
    for node, i in enumerate(kept, start=1):
        path, parent, value = drafted[i]
        if parent < 0:
            parent_node = 0
        else:
            slot = bisect.bisect_left(kept, parent)
            assert slot < len(kept) and kept[slot] == parent, "a kept node's parent was not kept"
            parent_node = slot + 1
        paths.append(path)
        parents.append(parent_node)
        values.append(value)
        for row in mask:  # a new column: no earlier node sees the new one
            row.append(False)
        row = list(mask[parent_node])  # the new node sees what its parent sees (the root and its ancestors) ...
        row[node] = True  # ... and itself
        mask.append(row)
    positions = [sum(row) - 1 for row in mask]
    return PortTree(paths, parents, values, mask, positions, expanded, frontiers, margin)


# ----------------------------------------------------------------------------- the engine, driven by the same drafter
def engine_tree(seed, total_token, depth, top_k, draft_vocab):
    """grow_pool + select_tree as `eagle_fsd.drafting.grow_tree` calls them. The fake draft forward carries each
    frontier node's root path as its state and checks the draft-side attention mask it is given against the paths."""
    width = VOCAB if draft_vocab is None else len(draft_vocab)
    forwards = []

    def forward_level(tokens, parent_states, level, level_mask):
        states = parent_states.clone()
        states[:, level + 1] = tokens  # a frontier node at forward `level` sits at depth level + 1
        paths = [tuple(int(t) for t in row if t >= 0) for row in states]
        forwards.append(paths)
        # level_mask[i, s * k + j]: frontier node j of forward s is node i or one of its ancestors
        seen = [p for earlier in forwards for p in earlier]
        expected = torch.tensor([[path[: len(other)] == other for other in seen] for path in paths])
        assert torch.equal(level_mask.cpu(), expected), f"draft attention mask of forward {level}"
        return torch.stack([drafter_logits(seed, p, width) for p in paths]), states

    root_state = torch.full((depth + 2,), -1, dtype=torch.long)
    root_state[0] = ROOT
    vocab = None if draft_vocab is None else torch.tensor(draft_vocab)
    pool = grow_pool(forward_level, drafter_logits(seed, (ROOT,), width), root_state, depth, top_k, vocab)
    return select_tree(torch.tensor(ROOT), pool, total_token, max_depth=depth + 1), forwards


def root_paths(tree) -> list[tuple[int, ...]]:
    paths = []
    for i, (token, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        paths.append((token,) if parent < 0 else paths[parent] + (token,))
    return paths


# ----------------------------------------------------------------------------- the comparison
SHAPES = [  # (total_token, depth, top_k)
    (60, 5, 10),   # EAGLE-2's defaults
    (24, 5, 4), (16, 3, 4), (12, 4, 2), (2, 1, 2), (16, 1, 8), (30, 6, 3),
    (6, 5, 1), (10, 4, 1),  # top_k = 1: a chain
    (8, 3, 1), (200, 3, 4), (100, 2, 5),  # total_token above the pool: every drafted node is kept
]
SEEDS = 15


@pytest.mark.parametrize("reduced_vocab", [False, True])
@pytest.mark.parametrize("total_token,depth,top_k", SHAPES)
def test_engine_builds_eagle2_trees(total_token, depth, top_k, reduced_vocab):
    compared = 0
    for seed in range(SEEDS):
        draft_vocab = None
        if reduced_vocab:  # FR-Spec: the drafter scores a subset of the target ids, columns mapped back to ids
            draft_vocab = sorted(torch.randperm(3 * VOCAB, generator=torch.Generator().manual_seed(seed))[:VOCAB]
                                 .tolist())
        width = VOCAB if draft_vocab is None else len(draft_vocab)
        port = eagle2_tree(lambda path: drafter_logits(seed, path, width), total_token, depth, top_k, draft_vocab)
        if port.margin < TIE_MARGIN:
            continue  # a near-tie: float32 and float64 may legitimately rank it differently
        compared += 1
        tree, forwards = engine_tree(seed, total_token, depth, top_k, draft_vocab)
        paths = root_paths(tree)
        where = f"seed {seed}"

        # the same nodes expanded, round by round
        assert [sorted(f) for f in forwards] == [sorted(f) for f in port.frontiers], where
        pool_size = top_k + depth * top_k * top_k
        assert tree.size == len(port.paths) == min(total_token, pool_size + 1), where
        assert sorted(paths) == sorted(port.paths), where  # same root paths (siblings are distinct tokens)
        by_depth = lambda ps: Counter((len(p) - 1, p[-1]) for p in ps)  # noqa: E731
        assert by_depth(paths) == by_depth(port.paths), where  # same token multiset per depth
        # same parent structure: each node's parent is the node on its path one step up
        assert sorted((p, paths[q] if q >= 0 else None) for p, q in zip(paths, tree.parents.tolist())) == \
            sorted((p, port.paths[q] if q >= 0 else None) for p, q in zip(port.paths, port.parents)), where
        # node by node, aligned by root path: values, positions, EAGLE's tree mask, draft distribution rows
        node_of = {p: i for i, p in enumerate(port.paths)}
        for i, p in enumerate(paths):
            j = node_of[p]
            assert tree.scores[i].item() == pytest.approx(port.values[j], abs=1e-4), where
            assert tree.depths[i].item() == port.positions[j], where
            row = [port.mask[j][node_of[other]] for other in paths]
            assert tree.tree_mask[i].tolist() == row, where
            if p in port.expanded:
                assert torch.equal(tree.draft_logits[tree.dist_index[i]], drafter_logits(seed, p, width)), where
            else:
                assert tree.dist_index[i].item() == -1, where
    assert compared >= SEEDS * 0.8, f"only {compared} of {SEEDS} cases were free of near-ties"
