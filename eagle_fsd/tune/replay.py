"""E[a + 1] for every tree shape by exact greedy replay.

The target's greedy continuation of a prompt is decoded once; then at every position the drafter grows its pool as
in a real step and the accepted length of every candidate tree is read off it: for greedy decoding the accepted path
is the longest prefix of that continuation the tree holds, so the replay is exact, and one pool per top_k serves
every depth and size.
"""
from __future__ import annotations

import sys

import torch

from eagle_fsd.cache import TreeCache
from eagle_fsd.hf import causal_mask, decoder_outputs
from eagle_fsd.tree.accept import acceptance_by_depth
from eagle_fsd.tree.dynamic import grow_pool

RANKS = 8  # the rank histogram counts the drafter's first RANKS root choices, and "none of them"


def target_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The features the drafter reads over ids (n,) (the target's final-norm hidden states, or for EAGLE-3 those
    entering its feature layers), from an empty cache, by the model's attention backend."""
    target = model.base_model
    cache = TreeCache.for_model(target, ids.numel(), model.plan.target)
    return decoder_outputs(target, ids, cache, causal_mask(0, ids.numel(), target.device),
                           torch.arange(ids.numel(), device=target.device), model.plan.target,
                           model.drafter.feature_layers)[1]


def accepted_path(pool, continuation: list[int]) -> list[int]:
    """Pool indices (1-based) of the pool nodes on the continuation: level L's node holds continuation[L - 1]."""
    tokens, parents, depths = pool.tokens.tolist(), pool.parents.tolist(), pool.depths.tolist()
    path, parent = [], 0
    for i, (tok, par, dep) in enumerate(zip(tokens, parents, depths)):
        level = len(path) + 1
        if dep == level and par == parent and level <= len(continuation) and tok == continuation[level - 1]:
            path.append(i + 1)
            parent = i + 1
    return path


def accepted_lengths(pool, continuation: list[int], sizes, depths) -> dict[tuple[int, int], int]:
    """(n, d) -> accepted length of the tree of n nodes selected from the first d + 1 pool levels (select_tree's
    stable rerank: a node's rank counts the nodes scoring higher, and equal ones drafted earlier)."""
    path = accepted_path(pool, continuation)
    scores, node_depth = pool.scores, pool.depths
    out = {}
    for d in depths:
        within = node_depth <= d + 1
        ranks = []
        for p in path[: d + 1]:
            s = scores[p - 1]
            earlier = torch.arange(scores.numel()) < p - 1
            ranks.append(int((within & ((scores > s) | ((scores == s) & earlier))).sum()))
        for n in sizes:
            # ranks grow along the path (a child never scores above its parent), so count the prefix that fits
            out[(n, d)] = sum(1 for r in ranks if r < n - 1)
    return out


def walk(lengths: list[dict], key) -> tuple[int, int]:
    """(tokens, steps) when decoding steps start at 0, then after each step's a + 1 tokens."""
    j = steps = tokens = 0
    while j < len(lengths):
        a = lengths[j][key]
        steps, tokens, j = steps + 1, tokens + a + 1, j + a + 1
    return tokens, steps


def cut_to_vocab(rows: list[dict], continuation: list[int], allowed: set | None) -> list[dict]:
    """Accepted lengths when the drafter can only propose tokens in `allowed` (None: all): at position j the path
    holds continuation[j + 1 ..]; it ends before the first token outside the vocabulary. (A lower bound: without
    the excluded competitors the reduced drafter ranks the remaining path tokens at least as high.)"""
    if allowed is None:
        return rows
    out = []
    for j, lengths in enumerate(rows):
        inside = 0
        while j + 1 + inside < len(continuation) and continuation[j + 1 + inside] in allowed:
            inside += 1
        out.append({key: min(a, inside) for key, a in lengths.items()})
    return out


def pool_lengths(drafter, root_logits, root_state, ahead: list[int], top_ks, max_depth: int, sizes) -> dict:
    """{(n, d, k): accepted length} of every tree a step at this root could verify, one pool per top_k; only trees
    no bigger than the pool that d draft forwards grow (n - 1 <= k + d k^2)."""
    lengths = {}
    for k in top_ks:
        pool = grow_pool(drafter.forward_level, root_logits, root_state, max_depth, k, drafter.draft_vocab)
        drafter.rollback()
        for (n, d), a in accepted_lengths(pool, ahead, sizes, range(1, max_depth + 1)).items():
            if n - 1 <= k + d * k * k:
                lengths[(n, d, k)] = a
    return lengths


def root_rank(root_logits: torch.Tensor, draft_vocab, token: int) -> int:
    """Rank of `token` among the drafter's first RANKS choices at the root (RANKS: not among them)."""
    order = root_logits.topk(RANKS).indices
    order = order if draft_vocab is None else draft_vocab[order]
    hit = (order == token).nonzero()
    return int(hit[0, 0]) if hit.numel() else RANKS


def replay(model, prompt: torch.Tensor, continuation: torch.Tensor, top_ks, max_depth: int, sizes, progress=None,
           positions: int | None = None):
    """Per position j of the target's greedy continuation (the first `positions`; None: every one that has
    max_depth + 1 tokens after it): {(n, d, k): accepted length} of the tree a step rooted at continuation[j] would
    verify, and the rank of continuation[j + 1] among the drafter's choices at the root."""
    target, drafter = model.base_model, model.drafter
    full = torch.cat([prompt, continuation]).to(target.device)
    p = prompt.numel()
    hidden = target_hidden(model, full)
    drafter.reset(full.numel() + 2 + max_depth * max(top_ks) + max(top_ks))
    root_logits, root_state = drafter.prefill(full[:p], full[p], hidden[:p])
    g = continuation.tolist()
    rows, ranks = [], []
    for j in range(min(len(g) - max_depth - 1, len(g) if positions is None else positions)):
        ahead = g[j + 1: j + max_depth + 2]
        rows.append(pool_lengths(drafter, root_logits, root_state, ahead, top_ks, max_depth, sizes))
        ranks.append(root_rank(root_logits, drafter.draft_vocab, ahead[0]))
        root_logits, root_state = drafter.extend(full[p + j + 1: p + j + 2], hidden[p + j: p + j + 1])
        if progress is not None:
            progress.update(1)
    return rows, ranks


def acceptance_per_depth(rows: list[list[dict]], key) -> list[float]:
    """P(depth d accepted | depth d - 1 accepted) of the tree `key` over every replayed position."""
    return [round(x, 4) for x in acceptance_by_depth([pos[key] for r in rows for pos in r])]


def tau_by_shape(rows: list[list[dict]], continuations: list[list[int]], vocabs: dict, top_ks, max_depth: int):
    """E[a + 1] of every shape (n, d, k, v), and the per-depth acceptance of the biggest tree of each (k, v).
    E[a + 1] is tokens over steps of all the prompts' walks together: time per token goes as 1 / E[a + 1], so a
    workload's speed is that of its pooled steps, not of the mean of its prompts' E[a + 1]."""
    tau, by_depth = {}, {}
    for v, v_ids in vocabs.items():
        # a reduced vocabulary cannot propose a token outside it: the accepted path stops before the first one
        allowed = None if v_ids is None else set(v_ids.tolist())
        rows_v = [cut_to_vocab(r, g, allowed) for r, g in zip(rows, continuations)]
        replayed = next((r for r in rows_v if r), [{}])  # a prompt answered in under max_depth + 1 tokens has none
        for key in replayed[0]:
            walks = [walk(r, key) for r in rows_v if r]
            tau[(*key, v)] = sum(t for t, _ in walks) / max(sum(s for _, s in walks), 1)
        for k in top_ks:
            biggest = max((s for s in tau if s[1] == max_depth and s[2] == k and s[3] == v), default=None)
            if biggest is not None:
                by_depth[(k, v)] = acceptance_per_depth(rows_v, biggest[:3])
    return tau, by_depth


def replay_prompts(model, ids, plain, top_ks, settings, sizes, progress: bool,
                   positions: int | None = None):
    """Replay rows and root ranks over every prompt's greedy continuation (its first `positions`), and those
    continuations; settings: the tuner's TuneSettings (new_tokens, max_depth)."""
    from tqdm import tqdm

    rows, ranks, continuations = [], [], []
    per_prompt = min(max(settings.new_tokens - settings.max_depth - 1, 1), positions or settings.new_tokens)
    with tqdm(total=len(ids) * per_prompt, desc="eagle-fsd tune: acceptance replay", disable=not progress,
              file=sys.stderr) as bar:
        for x, out in zip(ids, plain):
            continuations.append(out.sequences[0, x.numel():].tolist())
            r, rk = replay(model, x, out.sequences[0, x.numel():], top_ks, settings.max_depth, sizes, bar, positions)
            rows.append(r)
            ranks += rk
    return rows, ranks, continuations
