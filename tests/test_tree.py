"""Tree building and acceptance, checked node by node against brute force and branch by branch against chains."""
import pytest
import torch

from eagle_fsd.cache import TreeCache
from eagle_fsd.drafting import LMDrafter, grow_tree
from eagle_fsd.hf import causal_mask, decoder_forward, prefix_tree_mask
from eagle_fsd.tree.accept import accept
from eagle_fsd.tree.dynamic import DraftPool, chain_tree, select_tree
from eagle_fsd.tree.shape import TreeShape
from tiny import tiny_model


def random_pool(k, depth, vocab, gen):
    """A pool shaped like EAGLE-2 drafting: k root children, then per level k expanded nodes with k children."""
    tokens, scores, parents, depths = [], [], [], []
    lp = torch.log_softmax(torch.randn(vocab, generator=gen), -1).topk(k)
    tokens.append(lp.indices); scores.append(lp.values); parents.append(torch.zeros(k, dtype=torch.long))
    depths.append(torch.ones(k, dtype=torch.long))
    frontier = torch.arange(1, k + 1); frontier_scores = lp.values; n_pool = k
    for level in range(depth):
        child = torch.log_softmax(torch.randn(k, vocab, generator=gen), -1).topk(k)
        cum = frontier_scores[:, None] + child.values
        tokens.append(child.indices.flatten()); scores.append(cum.flatten())
        parents.append(frontier.repeat_interleave(k)); depths.append(torch.full((k * k,), level + 2))
        best = cum.flatten().topk(k)
        frontier = n_pool + 1 + best.indices; frontier_scores = best.values; n_pool += k * k
    return [torch.cat(x) for x in (tokens, scores, parents, depths)]


def brute_ancestors(parents, i):
    chain = [i]
    while parents[chain[-1]] >= 0:
        chain.append(int(parents[chain[-1]]))
    return chain[::-1]


@pytest.mark.parametrize("k,depth,total", [(10, 5, 60), (3, 4, 20), (1, 5, 60), (4, 1, 8), (2, 3, 200)])
def test_select_tree_structure(k, depth, total):
    gen = torch.Generator().manual_seed(k * 100 + depth)
    tokens, scores, parents, depths = random_pool(k, depth, 500, gen)
    dist_row = torch.full((tokens.numel() + 1,), -1)
    tree = select_tree(torch.tensor(7), DraftPool(tokens, scores, parents, depths, dist_row), total, depth + 1)
    n = tree.size
    assert n == min(total, tokens.numel() + 1)
    assert tree.tokens[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0
    # Parents precede children, depth = parent depth + 1, and the kept nodes are the best-scoring ones.
    assert (tree.parents[1:] < torch.arange(1, n)).all() and (tree.parents[1:] >= 0).all()
    assert torch.equal(tree.depths[1:], tree.depths[tree.parents[1:]] + 1)
    if n - 1 < tokens.numel():
        assert tree.scores[1:].min() >= scores.sort(descending=True).values[n - 2]
    for i in range(n):
        anc = brute_ancestors(tree.parents.tolist(), i)
        expected_row = torch.zeros(n, dtype=torch.bool); expected_row[anc] = True
        assert torch.equal(tree.tree_mask[i], expected_row)
        assert tree.ancestors[i, : len(anc)].tolist() == anc and (tree.ancestors[i, len(anc):] == -1).all()
    # retrieve_indices: one row per leaf, each the root-to-leaf path.
    leaves = sorted(set(range(n)) - set(tree.parents.tolist()))
    rows = tree.retrieve_indices
    assert rows.shape[0] == len(leaves)
    for row, leaf in zip(rows.tolist(), leaves):
        assert [x for x in row if x >= 0] == brute_ancestors(tree.parents.tolist(), leaf)


def test_select_tree_ties_keep_ancestors():
    """Log-probs that round to 0 give children the same score as their parent; the selection stays closed."""
    tokens = torch.arange(1, 7)
    scores = torch.tensor([0.0, -1.0, 0.0, 0.0, -2.0, 0.0])   # chain 1 -> 3 -> 4 -> 6 all with score 0
    parents = torch.tensor([0, 0, 1, 3, 2, 4])
    depths = torch.tensor([1, 1, 2, 3, 2, 4])
    tree = select_tree(torch.tensor(0), DraftPool(tokens, scores, parents, depths, torch.full((7,), -1)), 4, 4)
    assert tree.tokens.tolist() == [0, 1, 3, 4]
    assert tree.parents.tolist() == [-1, 0, 1, 2]


def test_accept_matches_brute_force_walk():
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        tokens, scores, parents, depths = random_pool(3, 3, 6, gen)  # tiny vocab: many matches
        pool = DraftPool(tokens, scores, parents, depths, torch.full((tokens.numel() + 1,), -1))
        tree = select_tree(torch.tensor(0), pool, 15, 4)
        choice = torch.randint(0, 6, (tree.size,), generator=gen)
        step = accept(tree, choice)
        path, accept_length, next_token = step.path, step.accept_length, step.next_token
        node, walk = 0, [0]
        while True:
            kids = [c for c in range(tree.size) if tree.parents[c] == node and tree.tokens[c] == choice[node]]
            if not kids:
                break
            assert len(kids) == 1
            node = kids[0]; walk.append(node)
        assert path.tolist() == walk and accept_length == len(walk) - 1 and next_token == choice[node]
        assert step.tokens == tree.tokens[walk[1:]].tolist() + [int(choice[node])] and step.fuzzy == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tree_verification_branch_by_branch(kind):
    """The target's logits at every tree node equal a plain forward over prefix + that node's root path."""
    target = tiny_model(kind, seed=1)
    drafter = LMDrafter(tiny_model(kind, seed=2), 1000)
    prefix = torch.randint(0, 1000, (9,), generator=torch.Generator().manual_seed(0))
    cache = TreeCache(2, 64)
    hidden = decoder_forward(target, prefix[:-1], cache, causal_mask(0, 8, "cpu"), torch.arange(8))
    root = prefix[-1]
    drafter.reset(128)
    root_lp, state = drafter.prefill(prefix[:-1], root)
    tree = grow_tree(drafter, root, root_lp, state, TreeShape(total_token=25, depth=4, branching=4))
    assert tree.depths.max() > 1
    hidden = decoder_forward(target, tree.tokens, cache, prefix_tree_mask(8, tree.tree_mask), 8 + tree.depths)
    tree_logits = target.lm_head(hidden)
    for i in range(tree.size):
        path = tree.ancestors[i, : int(tree.depths[i]) + 1]
        chain = torch.cat([prefix[:-1], tree.tokens[path]])
        ref = target(chain[None]).logits[0, -1]
        torch.testing.assert_close(tree_logits[i], ref, atol=1e-5, rtol=1e-5)
    # The drafter's tree levels must also equal its own chains: its draft distribution at each expanded node.
    for i in range(tree.size):
        row = int(tree.dist_index[i])
        if row < 0:
            continue
        path = tree.ancestors[i, : int(tree.depths[i]) + 1]
        chain = torch.cat([prefix[:-1], tree.tokens[path]])
        ref = torch.log_softmax(drafter.model(chain[None]).logits[0, -1], -1)
        torch.testing.assert_close(tree.draft_logprobs[row], ref, atol=1e-5, rtol=1e-5)


def test_cache_keep_compacts_to_accepted_path():
    """After keep(), decoding continues exactly as if only prefix + accepted path had ever been fed."""
    target = tiny_model(seed=4)
    prefix = torch.randint(0, 1000, (6,), generator=torch.Generator().manual_seed(1))
    cache = TreeCache(2, 40)
    decoder_forward(target, prefix, cache, causal_mask(0, 6, "cpu"), torch.arange(6))
    tokens = torch.tensor([11, 12, 13, 14, 15, 16])
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    depths = torch.tensor([0, 1, 1, 2, 2, 3])
    from eagle_fsd.tree.dynamic import ancestor_table, tree_mask_from_ancestors
    anc = ancestor_table(parents, depths, 3)
    decoder_forward(target, tokens, cache, prefix_tree_mask(6, tree_mask_from_ancestors(anc, depths)), 6 + depths)
    path = torch.tensor([0, 2, 4])
    cache.keep(6, path)
    assert cache.get_seq_length() == 9
    nxt = torch.tensor([77])
    h = decoder_forward(target, nxt, cache, causal_mask(9, 1, "cpu"), torch.tensor([9]))
    ref = target(torch.cat([prefix, tokens[path], nxt])[None]).logits[0, -1]
    torch.testing.assert_close(target.lm_head(h)[0], ref, atol=1e-5, rtol=1e-5)


def test_cache_keep_of_a_leading_chain_leaves_the_entries_in_place():
    """keep(start, 0 .. n-1) (the accepted chain of an LM drafter's levels) gives what moving each entry gives; a
    path that skips a slot still moves its entries."""
    g = torch.Generator().manual_seed(3)
    for path in ([0, 1, 2], [0, 2, 3], [1]):
        moved, kept = TreeCache(2, 20), TreeCache(2, 20)
        for layer in range(2):
            keys, values = torch.randn(2, 1, 2, 9, 4, generator=g)
            for cache in (moved, kept):
                cache.layers[layer].update(keys.clone(), values.clone())
        idx = torch.tensor(path)
        for layer in moved.layers:
            layer.keep(5, idx)
        kept.keep(5, idx)
        assert kept.get_seq_length() == moved.get_seq_length() == 5 + len(path)
        for a, b in zip(kept.layers, moved.layers):
            assert torch.equal(a.keys[:, :, :a.length], b.keys[:, :, :b.length])
            assert torch.equal(a.values[:, :, :a.length], b.values[:, :, :b.length])


def test_chain_tree_is_a_chain():
    tree = chain_tree(torch.tensor([5, 6, 7]))
    assert tree.parents.tolist() == [-1, 0, 1]
    assert torch.equal(tree.tree_mask, torch.ones(3, 3, dtype=torch.bool).tril())


def test_tokens_per_step():
    import math

    from eagle_fsd.tree.accept import tokens_per_step

    assert tokens_per_step(12, 6) == 3.0  # bonus token included: (12 + 6) / 6
    assert tokens_per_step(0, 4) == 1.0
    assert math.isnan(tokens_per_step(0, 0))
