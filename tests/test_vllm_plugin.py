"""The vLLM plugin's rule (eagle_fsd.vllm) without vLLM: settings, version check, and the chain walk against
hand-computed cases and against the tree engine's own FSD step on the chain it represents."""
import math
from dataclasses import replace

import pytest
import torch

from eagle_fsd.fsd import FsdConfig, fsd_accept
from eagle_fsd.tree.dynamic import chain_tree
from eagle_fsd.vllm import DraftChain, check_vllm_version, fuzzy_chain, request_fsd


def test_request_settings_come_from_extra_args_then_the_environment():
    assert request_fsd(None, environ={}) is None
    assert request_fsd({"other": 1}, environ={}) is None
    assert request_fsd({"fsd_threshold": 2}, environ={}) == FsdConfig(threshold=2.0, divergence="kl_qp")
    env = {"EAGLE_FSD_THRESHOLD": "0.5", "EAGLE_FSD_DIVERGENCE": "jsd"}
    assert request_fsd(None, environ=env) == FsdConfig(threshold=0.5, divergence="jsd")
    assert request_fsd({"fsd_threshold": 3, "fsd_divergence": "tv"}, environ=env) == FsdConfig(3.0, "tv")
    assert request_fsd({"fsd_threshold": "inf"}, environ={}).threshold == math.inf
    with pytest.raises(ValueError, match="fsd_threshold='high'"):
        request_fsd({"fsd_threshold": "high"}, environ={})
    with pytest.raises(ValueError, match="fsd_threshold=-1.0"):
        request_fsd({"fsd_threshold": -1}, environ={})
    with pytest.raises(ValueError, match="fsd_divergence='kl'"):
        request_fsd({"fsd_threshold": 1, "fsd_divergence": "kl"}, environ={})


def test_unsupported_vllm_version_is_refused_with_the_supported_one():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.1+cpu")
    for version in ("0.33.0", "0.3.2", "1.32.0"):
        with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x, not " + version.replace(".", r"\.")):
            check_vllm_version(version)


def one_hot_logits(tokens, vocab=6, weight=4.0):
    """Rows of logits whose argmax is the given token (the rest equal)."""
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = weight
    return logits


def test_greedy_chain_by_hand():
    drafts = torch.tensor([1, 2, 3])
    target = one_hot_logits([0, 2, 5])  # the target picks 0, 2, 5 after the three contexts
    draft = one_hot_logits([1, 2, 3])
    bonus = torch.softmax(one_hot_logits([4])[0], -1)
    probs = target.softmax(-1)
    d = [float(torch.nn.functional.kl_div(target[i].log_softmax(-1), draft[i].log_softmax(-1), log_target=True,
                                          reduction="sum")) for i in range(3)]  # KL(q || p) per position
    assert d[0] > 0 and d[1] == 0 and d[2] > 0
    kept = [0]  # vLLM rejected draft 0 and emitted the target's 0
    chain = DraftChain(drafts, target, probs, draft.softmax(-1), None, bonus)
    # T below D_0: vLLM's output stands
    assert fuzzy_chain(kept, chain, FsdConfig(d[0] * 0.99), True) == [0]
    # T above D_0: draft 0 kept fuzzily, draft 1 matches the target, draft 2 (D_2 = D_0 < T) kept fuzzily, bonus 4
    assert fuzzy_chain(kept, chain, FsdConfig(d[0] * 1.01), True) == [1, 2, 3, 4]
    # a target that is sure at position 2 makes D_2 larger than T: stop there with the target's 5
    target2 = target.clone()
    target2[2, 5] = 12.0
    d2 = float(torch.nn.functional.kl_div(target2[2].log_softmax(-1), draft[2].log_softmax(-1), log_target=True,
                                          reduction="sum"))
    t = FsdConfig(d[0] * 1.01)
    assert d2 > t.threshold
    sure = DraftChain(drafts, target2, target2.softmax(-1), draft.softmax(-1), None, bonus)
    assert fuzzy_chain(kept, sure, t, True) == [1, 2, 5]
    # everything vLLM accepted already (bonus included) is left alone
    assert fuzzy_chain([1, 2, 3, 4], chain, t, True) == [1, 2, 3, 4]


def test_sampled_chain_by_hand():
    """Sampling, one-hot q' (greedy drafting): the lossless test keeps d with probability p(d). A target sure of
    every draft after the first keeps them all; the residual of a rejected draft is p without d."""
    drafts = torch.tensor([1, 2, 3])
    probs = torch.tensor([[0.5, 0.0, 0.5, 0, 0, 0], [0, 0, 1.0, 0, 0, 0], [0, 0, 0, 1.0, 0, 0]])
    target = probs.clamp_min(1e-9).log()
    draft = torch.softmax(one_hot_logits([1, 2, 3]), -1)
    bonus = torch.tensor([0, 0, 0, 0, 1.0, 0])
    generator = torch.Generator().manual_seed(0)
    chain = DraftChain(drafts, target, probs, draft, None, bonus)
    assert fuzzy_chain([2], chain, FsdConfig(0.0), False, generator) == [2]
    assert fuzzy_chain([2], chain, FsdConfig(math.inf), False, generator) == [1, 2, 3, 4]
    # D_0 < T < D_1: draft 0 is kept fuzzily; the target at position 1 all but rules draft 2 out (p = 6e-6) and is
    # too far from the drafter to keep it fuzzily; the residual p - onehot(2) puts all but 1e-5 of its mass on 5
    target = torch.zeros(3, 6)
    target[1, 5] = 12.0
    d = [float((draft[i] * (draft[i].log() - target[i].log_softmax(-1))).sum()) for i in range(2)]  # KL(q || p)
    assert d[0] < 3 < d[1]
    chain = DraftChain(drafts, target, target.softmax(-1), draft, None, bonus)
    tokens = fuzzy_chain([2], chain, FsdConfig(3.0), False, generator)
    assert tokens == [1, 5]


def test_sampled_walk_uses_vllms_ratio_and_residual():
    """Probabilistic drafts (q' given): a draft with p(d) = q'(d) = 0.5 always passes the lossless test (ratio 1),
    and a rejected draft is replaced from max(p - q', 0), which here holds only token 0."""
    drafts = torch.tensor([1, 2, 3])
    probs = torch.tensor([[0.3, 0.0, 0.0, 0.0, 0.0, 0.7], [0.0, 0.0, 0.5, 0.0, 0.5, 0.0],
                          [0.5, 0.0, 0.0, 0.5, 0.0, 0.0]])
    lossless_q = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5, 0.0, 0.0],
                               [0.0, 0.0, 0.0, 0.5, 0.0, 0.5]])
    bonus = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    target = probs.clamp_min(1e-9).log()
    chain = DraftChain(drafts, target, probs, lossless_q, lossless_q, bonus)
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        tokens = fuzzy_chain([5], chain, FsdConfig(math.inf), False, generator)
        assert tokens == [1, 2, 3, 5], seed  # draft 0 fuzzily (vLLM rejected it), drafts 1 and 2 by ratio 1
    # draft 1 now has p(2) = 0.25 < q'(2) = 0.5; where it is rejected, with D_1 infinite (no fuzzy accept),
    # the replacement is drawn from max(p - q', 0) = token 4 only
    probs[1] = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.75, 0.0])
    lossless_q[1] = torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0])  # KL(q' || p) = inf: q' has mass on 3, p none
    logits_for_d, q_for_d = probs.clamp_min(0).log(), lossless_q.clone()
    logits_for_d[0], q_for_d[0] = 0.0, 1 / 6  # D_0 = 0: draft 0 is kept fuzzily
    chain = DraftChain(drafts, logits_for_d, probs, q_for_d, lossless_q, bonus)
    outcomes = set()
    for seed in range(40):
        generator = torch.Generator().manual_seed(seed)
        outcomes.add(tuple(fuzzy_chain([5], chain, FsdConfig(1e6), False, generator)))
    assert outcomes == {(1, 4), (1, 2, 3, 5)}


def test_below_threshold_the_walk_is_vllms_and_draws_nothing():
    """Sampling, D at vLLM's first rejection >= T (T = 0 always): vLLM's tokens come back and the request's random
    stream is untouched, so every later vLLM draw is the one it would have made."""
    drafts = torch.tensor([1, 2, 3])
    target = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))
    draft = torch.softmax(one_hot_logits([1, 2, 3]), -1)
    generator = torch.Generator().manual_seed(5)
    state = generator.get_state()
    chain = DraftChain(drafts, target, target.softmax(-1), draft, draft, target[0].softmax(-1))
    for kept in ([4], [1, 0], [1, 2, 5]):
        assert fuzzy_chain(kept, chain, FsdConfig(0.0), False, generator) == kept
    assert torch.equal(generator.get_state(), state)


def test_the_chain_walk_is_the_tree_engines_step_on_that_chain():
    """Greedy: for random chains and thresholds, fuzzy_chain after vLLM's lossless prefix emits exactly what the
    tree engine's fsd_accept emits on a chain tree with the same distributions."""
    generator = torch.Generator().manual_seed(1)
    vocab, n = 5, 4
    agreed = fuzzy = 0
    for trial in range(300):
        target = torch.randn(n + 1, vocab, generator=generator) * 2
        draft = target[:n] + torch.randn(n, vocab, generator=generator)
        drafts = draft.argmax(-1)
        drafts[trial % n] = (drafts[trial % n] + 1) % vocab  # a rejection somewhere
        for divergence in ("kl_qp", "jsd"):
            fsd = FsdConfig(threshold=float(torch.rand((), generator=generator)) * 2, divergence=divergence)
            choice = target.argmax(-1)
            kept = []  # vLLM's greedy rule: drafts while they match, then the target's token
            for i in range(n + 1):
                kept.append(int(choice[i]))
                if i == n or drafts[i] != choice[i]:
                    break
            tree = replace(chain_tree(torch.cat([torch.tensor([0]), drafts])),
                           dist_index=torch.tensor([*range(n), -1]), draft_logits=draft)
            step = fsd_accept(tree, target, choice, fsd, vocab)
            chain = DraftChain(drafts, target[:n], target[:n].softmax(-1), draft.softmax(-1), None,
                               target[n].softmax(-1))
            tokens = fuzzy_chain(kept, chain, fsd, True)
            assert tokens == step.tokens, (trial, divergence)
            agreed += 1
            fuzzy += step.fuzzy > 0
    assert agreed == 600 and fuzzy > 50  # the comparison exercised the fuzzy path, not only lossless steps
