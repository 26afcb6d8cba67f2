"""FSD at T = inf when divergences are +inf (q = 0 where p has mass: a reduced draft vocabulary with KL(p||q), or
processed distributions). Reducible: the top-ranked child is accepted wherever the lossless rule rejects every
child, whatever D is; original: at every node. A NaN D (no divergence computed) never accepts."""
import math

import pytest
import torch

from eagle_fsd.drafting import LMDrafter
from eagle_fsd.model import EaFsdModel
from eagle_fsd.fsd import FsdConfig, fuzzy_choices
from eagle_fsd.tree.accept import accept
from test_fsd import hand_tree  # root(0) -> 10 (top), 11, 12; 10 -> 20 (top), 21; 11 -> 30
from tiny import tiny_model

INF, NAN = math.inf, math.nan


def divergences(root, node10, node11):
    """D at the three expanded nodes; the leaves have none (NaN)."""
    return torch.tensor([root, node10, node11, NAN, NAN, NAN, NAN])


def walk(tree, target, div, threshold, mode):
    choice, blocked = fuzzy_choices(tree, target, div, threshold, mode)
    return accept(tree, choice, blocked, target, div)


def test_reducible_at_inf_accepts_infinite_divergences():
    tree = hand_tree()
    no_match = torch.tensor([99, 98, 30, 5, 6, 7, 8])  # root and node(10) have no matching child
    step = walk(tree, no_match, divergences(INF, INF, INF), INF, "reducible")
    assert step.path.tolist() == [0, 1, 4] and step.tokens == [10, 20, 6] and step.fuzzy == 2
    # any finite T, however large (beyond float32's range too), keeps D = +inf out: the lossless rule alone
    step = walk(tree, no_match, divergences(INF, INF, INF), 1e300, "reducible")
    assert step.accept_length == 0 and step.tokens == [99]
    # a matching child still wins over the top-ranked one
    match = torch.tensor([11, 98, 30, 5, 6, 7, 8])
    step = walk(tree, match, divergences(INF, INF, INF), INF, "reducible")
    assert step.path.tolist() == [0, 2, 6] and step.tokens == [11, 30, 8] and step.fuzzy == 0
    # NaN never accepts: node(10) has no divergence, so the walk stops there with the target's own 98
    step = walk(tree, no_match, divergences(INF, NAN, INF), INF, "reducible")
    assert step.tokens == [10, 98] and step.fuzzy == 1


def test_original_at_inf_accepts_infinite_divergences():
    tree = hand_tree()
    target = torch.tensor([11, 21, 30, 5, 6, 7, 8])  # the target prefers 11 at the root and 21 at node(10)
    step = walk(tree, target, divergences(INF, INF, INF), INF, "original")
    assert step.path.tolist() == [0, 1, 4] and step.tokens == [10, 20, 6] and step.fuzzy == 2
    step = walk(tree, target, divergences(INF, INF, INF), 1e300, "original")
    assert step.accept_length == 0 and step.tokens == [11]  # D = +inf > T (a float64 T): blocked at the root
    step = walk(tree, target, divergences(INF, NAN, INF), INF, "original")
    assert step.tokens == [10, 21]  # NaN at node(10): blocked there, the target's 21 ends the step


@pytest.mark.parametrize("mode", ["reducible", "original"])
def test_generate_at_inf_with_reduced_draft_vocab_and_kl_pq(mode):
    """KL(p||q) is +inf at every node when q is 0 on half the vocabulary; T = inf still accepts the whole chain."""
    target = tiny_model(seed=1)
    drafter = LMDrafter(tiny_model(seed=9), 1000)
    drafter.draft_head.set_draft_vocab(torch.arange(0, 1000, 2))
    model = EaFsdModel(target, None, drafter, total_token=8, depth=4, top_k=1)  # a chain of 5 draft tokens
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=25, eos_token_id=[], fsd=FsdConfig(INF, "kl_pq", mode),
                         return_dict=True)
    assert out.accept_lengths == [5] * 4 and out.fuzzy_fraction > 0.5
    computed = [d for step in out.divergences for d in step if not math.isnan(d)]  # NaN: a leaf, no children
    assert len(computed) == 4 * 5 and all(d == INF for d in computed)  # the case under test: D = +inf everywhere
