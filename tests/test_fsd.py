"""FSD acceptance rules on hand-built trees and on tiny models."""
import math

import pytest
import torch

from eagle_fsd.drafting import LMDrafter
from eagle_fsd.divergence import align_vocab, divergence
from eagle_fsd.fsd import FsdConfig, fuzzy_choices, node_divergences
from eagle_fsd.model import EaFsdModel
from eagle_fsd.tree.accept import accept, top_child
from eagle_fsd.tree.dynamic import DraftPool, DraftTree, ancestor_table, select_tree, tree_mask_from_ancestors
from tiny import hf_greedy, tiny_model


def hand_tree():
    """root(0) -> children 10 (top-ranked), 11, 12; node(10) -> 20 (top), 21; node(11) -> 30."""
    tokens = torch.tensor([0, 10, 11, 12, 20, 21, 30])
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2])
    depths = torch.tensor([0, 1, 1, 1, 2, 2, 2])
    anc = ancestor_table(parents, depths, 2)
    return DraftTree(tokens, parents, depths, anc, tree_mask_from_ancestors(anc, depths), torch.zeros(7),
                     torch.tensor([0, 1, 2, -1, -1, -1, -1]))


def test_top_child_is_first_sibling():
    assert top_child(hand_tree()).tolist() == [1, 4, 6, -1, -1, -1, -1]


def test_reducible_rule():
    tree = hand_tree()
    div = torch.tensor([0.2, 0.5, 0.1, math.nan, math.nan, math.nan, math.nan])
    # target: root -> 99 (no child), node(10) -> 99, node(11) -> 30 (a match)
    target = torch.tensor([99, 99, 30, 5, 6, 7, 8])
    # T = 0 is the lossless rule: nothing accepted, the next token is the target's 99
    choice, blocked = fuzzy_choices(tree, target, div, 0.0, "reducible")
    step = accept(tree, choice, blocked, target, div)
    assert torch.equal(choice, target) and step.accept_length == 0 and step.tokens == [99] and step.fuzzy == 0
    # T = 0.3: root's D (0.2) < T -> top child 10 fuzzily; node(10)'s D (0.5) >= T -> stop with its own choice
    choice, blocked = fuzzy_choices(tree, target, div, 0.3, "reducible")
    step = accept(tree, choice, blocked, target, div)
    assert step.path.tolist() == [0, 1] and step.tokens == [10, 99] and step.fuzzy == 1
    assert step.fuzzy_mask == [True, False]  # the draft token 10 is fuzzy; the target's own 99 never is
    assert step.divergences == pytest.approx([0.2, 0.5])
    # when the target's own choice is a child, the lossless match wins over the top-ranked child
    target2 = torch.tensor([11, 99, 30, 5, 6, 7, 8])
    choice, blocked = fuzzy_choices(tree, target2, div, 10.0, "reducible")
    step = accept(tree, choice, blocked, target2, div)
    assert step.path.tolist() == [0, 2, 6] and step.tokens == [11, 30, 8] and step.fuzzy == 0
    assert step.fuzzy_mask == [False, False, False]
    # NaN divergence never accepts
    nan_div = torch.full((7,), math.nan)
    choice, _ = fuzzy_choices(tree, target, nan_div, math.inf, "reducible")
    assert torch.equal(choice, target)


def test_original_rule():
    tree = hand_tree()
    div = torch.tensor([0.2, 0.5, 0.1, math.nan, math.nan, math.nan, math.nan])
    target = torch.tensor([11, 21, 30, 5, 6, 7, 8])
    # T = 0: D > 0 everywhere, so even the exact match 11 is not accepted: one target token per step
    choice, blocked = fuzzy_choices(tree, target, div, 0.0, "original")
    step = accept(tree, choice, blocked, target, div)
    assert step.accept_length == 0 and step.tokens == [11]
    # T = 0.3: root takes its top child 10 (although the target chose 11); node(10) has D 0.5 > T: stop, emit 21
    choice, blocked = fuzzy_choices(tree, target, div, 0.3, "original")
    step = accept(tree, choice, blocked, target, div)
    assert step.tokens == [10, 21] and step.fuzzy == 1
    # T = inf: the top-ranked path to a leaf
    choice, blocked = fuzzy_choices(tree, target, div, math.inf, "original")
    assert accept(tree, choice, blocked, target, div).tokens == [10, 20, 6]


@pytest.mark.parametrize("kwargs,message", [
    (dict(threshold=-0.1), "fsd_threshold"), (dict(threshold=math.nan), "fsd_threshold"),
    (dict(threshold=0.1, divergence="kl"), "fsd_divergence"), (dict(threshold=0.1, mode="lossy"), "fsd_mode"),
    (dict(threshold=0.1, distributions="warped"), "fsd_distributions"), (dict(threshold=0.1, top_k=0), "fsd_top_k"),
])
def test_bad_fsd_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FsdConfig(**kwargs)


def pair(seed_target=1, seed_draft=9, **tree):
    target = tiny_model(seed=seed_target)
    draft = tiny_model(seed=seed_draft)
    return target, EaFsdModel(target, None, LMDrafter(draft, 1000), **tree)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_reducible_at_zero_is_bit_identical(temperature):
    target, model = pair(total_token=20, depth=3, top_k=4)
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    runs = []
    for fsd in (None, 0.0):
        torch.manual_seed(123)
        runs.append(model.generate(ids, max_new_tokens=30, temperature=temperature, eos_token_id=[],
                                   fsd_threshold=fsd, return_dict=True))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].accept_lengths == runs[1].accept_lengths and sum(runs[1].fuzzy_accepts) == 0


@pytest.mark.parametrize("mode", ["reducible", "original"])
@pytest.mark.parametrize("divergence", ["kl_qp", "kl_pq", "jsd", "tv", "legacy_js"])
def test_infinite_threshold_accepts_to_the_depth_limit(mode, divergence):
    target, model = pair(total_token=8, depth=4, top_k=1)  # a chain of 5 draft tokens
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=37, eos_token_id=[], fsd=FsdConfig(math.inf, divergence, mode),
                         return_dict=True)
    assert out.accept_lengths == [5] * len(out.accept_lengths) and out.tau == 6.0
    assert out.fuzzy_fraction > 0.9  # random draft and target: nearly every token was accepted only fuzzily
    # 37 = 1 + 6 steps of 6 tokens: the per-token flags agree with the per-step counts, and each step ends on the
    # target's own token, never fuzzy
    assert len(out.fuzzy_mask) == out.new_tokens and sum(out.fuzzy_mask) == sum(out.fuzzy_accepts)
    assert all(not out.fuzzy_mask[i] for i in range(0, out.new_tokens, 6))  # the prefill token, then every 6th


def test_original_at_zero_is_plain_decoding():
    """Original FSD at T = 0 accepts a draft token only where D is exactly 0; for a different drafter, never:
    every step emits one target token, so greedy output is the target's own."""
    target, model = pair(total_token=20, depth=3, top_k=4)
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, max_new_tokens=20, eos_token_id=[], fsd=FsdConfig(0.0, mode="original"),
                         return_dict=True)
    assert set(out.accept_lengths) == {0}
    assert torch.equal(out.sequences, hf_greedy(target, ids, 20))


def test_fsd_threshold_is_short_for_a_config():
    target, model = pair(total_token=20, depth=3, top_k=4)
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(3))
    a = model.generate(ids, max_new_tokens=20, eos_token_id=[], fsd_threshold=3.0)
    b = model.generate(ids, max_new_tokens=20, eos_token_id=[], fsd=FsdConfig(3.0))
    assert torch.equal(a, b)
    tv = model.generate(ids, max_new_tokens=20, eos_token_id=[], fsd=FsdConfig(3.0, "tv"))
    assert tv.shape == a.shape
    with pytest.raises(ValueError, match="fsd_divergence"):
        model.generate(ids, max_new_tokens=5, fsd=FsdConfig(0.1, "nope"))
    with pytest.raises(ValueError, match="not both"):
        model.generate(ids, max_new_tokens=5, fsd=FsdConfig(0.1), fsd_threshold=0.1)
    with pytest.raises(TypeError, match="fsd_divergence"):  # the flat FSD keywords are gone: one FsdConfig
        model.generate(ids, max_new_tokens=5, fsd_threshold=0.1, fsd_divergence="tv")


def test_fused_kernel_names_are_fsd_names():
    """The kernel keeps its own list of the divergences it fuses; FSD may only dispatch names it knows."""
    from eagle_fsd.divergence import DIVERGENCES
    from eagle_fsd.kernels import FUSED_DIVERGENCES

    assert FUSED_DIVERGENCES and set(FUSED_DIVERGENCES) <= set(DIVERGENCES)


# ---------------------------------------------------------------- exact prefix guard
def test_keep_exact_restores_the_lossless_choices_above_a_depth():
    tree = hand_tree()
    target = torch.tensor([99, 98, 97, 96, 95, 94, 93])  # no child matches anywhere: lossless stops at the root
    relaxed, blocked = fuzzy_choices(tree, target, torch.zeros(7), 1.0, "original")  # D = 0: every child taken
    assert accept(tree, relaxed, blocked, target).tokens == [10, 20, 95]
    from eagle_fsd.fsd import keep_exact

    for depth, tokens in ((1, [99]), (2, [99])):  # the root's choice is exact: the step stops there
        choice, kept_blocked = keep_exact(tree, target, relaxed, blocked, depth)
        assert accept(tree, choice, kept_blocked, target).tokens == tokens
    choice, kept_blocked = keep_exact(tree, target, relaxed, blocked, 0)
    assert accept(tree, choice, kept_blocked, target).tokens == [10, 20, 95]
    target[0] = 10  # the target takes child 10 itself; node 10 is still inside the exact prefix at depth 2
    choice, kept_blocked = keep_exact(tree, target, relaxed, blocked, 2)
    step = accept(tree, choice, kept_blocked, target)
    assert step.tokens == [10, 98] and step.fuzzy == 0


@pytest.mark.parametrize("mode", ["reducible", "original"])
@pytest.mark.parametrize("prefix", [1, 7, 12])
def test_exact_prefix_is_the_targets_own_then_fuzzy(mode, prefix):
    """T = inf on a random pair accepts every draft token fuzzily; with exact_prefix L the first L new tokens are
    the target's own greedy tokens, none fuzzy, and the token right after them is fuzzy again."""
    target, model = pair(total_token=8, depth=4, top_k=1)
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(4))
    out = model.generate(ids, max_new_tokens=30, eos_token_id=[], return_dict=True,
                         fsd=FsdConfig(math.inf, "kl_qp", mode, exact_prefix=prefix))
    greedy = hf_greedy(target, ids, 30)[0, 8:]
    new = out.sequences[0, 8:]
    assert torch.equal(new[:prefix], greedy[:prefix])
    assert not any(out.fuzzy_mask[:prefix]) and out.fuzzy_mask[prefix]
    assert not torch.equal(new, greedy)


def test_exact_prefix_covering_the_reply_is_lossless():
    target, model = pair(total_token=8, depth=4, top_k=1)
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(5))
    out = model.generate(ids, max_new_tokens=20, eos_token_id=[], return_dict=True,
                         fsd=FsdConfig(math.inf, exact_prefix=20))
    assert torch.equal(out.sequences, hf_greedy(target, ids, 20)) and sum(out.fuzzy_accepts) == 0


def test_bad_exact_prefix_names_the_value():
    with pytest.raises(ValueError, match="fsd_exact_prefix=-1"):
        FsdConfig(1.0, exact_prefix=-1)


@pytest.mark.parametrize("name", ["kl_qp", "jsd"])
def test_node_divergences_over_a_reduced_draft_vocabulary_node_by_node(name):
    """Each expanded node's D is the divergence of its own target row and draft row, q scattered onto the target
    vocabulary and both cut to the tokenizer's size (draft ids past it dropped); NaN at unexpanded nodes. kl_qp
    takes the draft-vocabulary path, jsd the full-vocabulary one: both must give that."""
    gen = torch.Generator().manual_seed(3)
    width, vocab_size = 60, 50
    draft_vocab = torch.cat([torch.randperm(50, generator=gen)[:20], torch.tensor([52, 57])])
    # root -> pool nodes 1, 2 (depth 1); node 1 -> pool node 3 (depth 2); root and node 1 expanded
    pool = DraftPool(tokens=draft_vocab[:3].clone(), scores=torch.tensor([-0.1, -0.7, -0.3]),
                     parents=torch.tensor([0, 0, 1]), depths=torch.tensor([1, 1, 2]),
                     dist_row=torch.tensor([0, 1, -1, -1]),
                     draft_logits=torch.randn(2, draft_vocab.numel(), generator=gen) * 2, draft_vocab=draft_vocab)
    tree = select_tree(torch.tensor(7), pool, 4, 2)
    target_logits = torch.randn(tree.size, width, generator=gen) * 2
    got = node_divergences(tree, target_logits, FsdConfig(1.0, name), vocab_size)
    expanded = tree.dist_index >= 0
    assert expanded.sum() == 2 and torch.isnan(got[~expanded]).all()
    draft = tree.draft_logprobs_over(width)[tree.dist_index[expanded]]
    want = divergence(*align_vocab(target_logits[expanded], draft, vocab_size), name)
    torch.testing.assert_close(got[expanded], want, rtol=1e-5, atol=1e-6)
