"""Sampling is lossless: emitted tokens follow the target's processed distribution (chi-square tests).

Each test also checks its own power: the same samples must reject a distribution moved 5 % in total variation
towards the drafter's (the likeliest way a broken acceptance rule would bias the output).
"""
import pytest
import torch

from eagle_fsd.drafting import LMDrafter
from eagle_fsd.model import EaFsdModel
from eagle_fsd.sampling import logits_processor, processed_probs
from eagle_fsd.tree.accept import accept
from eagle_fsd.tree.dynamic import ancestor_table, DraftTree, tree_mask_from_ancestors
from tiny import tiny_model


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    n = counts.sum()
    expected = expected_probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def shifted(p: torch.Tensor, towards: torch.Tensor, tv: float = 0.05) -> torch.Tensor:
    """p moved along (towards - p) until its total-variation distance from p is `tv`."""
    distance = 0.5 * (towards - p).abs().sum()
    return p + (tv / distance) * (towards - p)


def small_tree(vocab=6):
    """root -> children {1, 2, 3}; node(1) -> {0, 4}; node(2) -> {5}."""
    tokens = torch.tensor([0, 1, 2, 3, 0, 4, 5])
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2])
    depths = torch.tensor([0, 1, 1, 1, 2, 2, 2])
    anc = ancestor_table(parents, depths, 2)
    return DraftTree(tokens, parents, depths, anc, tree_mask_from_ancestors(anc, depths), torch.zeros(7),
                     torch.full((7,), -1))


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 4)])
def test_tree_acceptance_law(temperature, top_k):
    """Exact law of the first two emitted tokens (e1, e2) for a fixed tree and fixed target logits."""
    gen = torch.Generator().manual_seed(0)
    tree, vocab = small_tree(), 6
    logits = 2.0 * torch.randn(tree.size, vocab, generator=gen)
    processor = logits_processor(temperature, 1.0, top_k)
    p = processed_probs(logits, processor)
    # Expected law: e1 ~ p_root; if e1 is the token of a child c, e2 ~ p_c, else e2 is "next step" (cell index V).
    child_of = {int(tree.tokens[c]): c for c in range(1, 4)}
    expected = torch.zeros(vocab, vocab + 1, dtype=torch.float64)
    for e1 in range(vocab):
        if e1 in child_of:
            expected[e1, :vocab] = p[0, e1] * p[child_of[e1]]
        else:
            expected[e1, vocab] = p[0, e1]
    torch.manual_seed(1)
    n = 40000
    counts = torch.zeros(vocab, vocab + 1)
    choices = torch.multinomial(p, n, replacement=True).T  # one target choice per node per trial
    for choice in choices:
        emitted = accept(tree, choice).tokens
        counts[emitted[0], emitted[1] if len(emitted) > 1 else vocab] += 1
    assert chi2_pvalue(counts.flatten(), expected.flatten()) > 1e-3
    draft_like = torch.zeros_like(expected); draft_like[1, 0] = 1.0  # all mass on the draft's top path
    assert chi2_pvalue(counts.flatten(), shifted(expected.flatten(), draft_like.flatten())) < 1e-3


def test_engine_sampling_matches_target(temperature=0.8, top_p=0.9, top_k=5):
    """Joint law of the first two generated tokens of EaFsdModel.generate vs the target's exact law."""
    vocab = 8
    target = tiny_model(vocab=vocab, seed=11, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    draft = tiny_model(vocab=vocab, seed=12, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    with torch.no_grad():  # sharpen both models so that draft and target disagree in interesting ways
        target.lm_head.weight.mul_(40)
        draft.lm_head.weight.mul_(40)
    model = EaFsdModel(target, None, LMDrafter(draft, vocab), total_token=6, depth=2, top_k=2)
    prompt = torch.tensor([[3, 1, 4]])
    processor = logits_processor(temperature, top_p, top_k)
    with torch.no_grad():
        p1 = processed_probs(target(prompt).logits[0, -1:], processor)[0]
        second = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        p2 = processed_probs(target(second).logits[:, -1], processor)
        d1 = torch.softmax(draft(prompt).logits[0, -1], -1)
        d2 = torch.softmax(draft(second).logits[:, -1], -1)
    expected = (p1[:, None] * p2).flatten()
    torch.manual_seed(0)
    counts = torch.zeros(vocab * vocab)
    n = 4000
    for _ in range(n):
        out = model.generate(prompt, max_new_tokens=2, temperature=temperature, top_p=top_p, top_k=top_k,
                             eos_token_id=[])
        counts[out[0, 3] * vocab + out[0, 4]] += 1
    assert chi2_pvalue(counts, expected) > 1e-3
    # second token biased 5 % (TV) towards the drafter's choice
    assert chi2_pvalue(counts, (p1[:, None] * shifted_rows(p2, d2)).flatten()) < 1e-3


def shifted_rows(p, towards):
    return torch.stack([shifted(a, b) for a, b in zip(p, towards)])
