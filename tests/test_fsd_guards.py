"""FSD's guards (eagle_fsd.fsd: keep_stop, top_r, margin, min_entropy) on hand-built distributions: each closes the
nodes it should and no other, T = 0 stays lossless with every guard, and the vLLM chain rule honours them too."""
import math

import pytest
import torch

from eagle_fsd.drafting import LMDrafter
from eagle_fsd.fsd import FsdConfig, fuzzy_allowed, fuzzy_choices, guarded_divergences
from eagle_fsd.model import EaFsdModel
from eagle_fsd.tree.accept import accept
from eagle_fsd.vllm import DraftChain, fuzzy_chain
from test_fsd import hand_tree
from tiny import hf_greedy, tiny_model

V = 100
STOP = 99
DIV = torch.tensor([0.2, 0.5, 0.1, math.nan, math.nan, math.nan, math.nan])  # T = 0.3: root open, node(10) not
TARGET = torch.tensor([STOP, 98, 30, 5, 6, 7, 8])  # root: the stop token; node(10): 98 (no child); node(11): 30


def logits_with(rows: dict[int, dict[int, float]], flat: float = 0.0) -> torch.Tensor:
    """(7, V) target logits: `flat` everywhere, then row -> {token: logit}."""
    logits = torch.full((7, V), flat)
    for row, values in rows.items():
        for token, value in values.items():
            logits[row, token] = value
    return logits


def step_tokens(fsd: FsdConfig, logits: torch.Tensor, stop_ids=None) -> list[int]:
    tree = hand_tree()
    ruled = guarded_divergences(tree, logits, TARGET, DIV, fsd, V, stop_ids)
    choice, blocked = fuzzy_choices(tree, TARGET, ruled, fsd.threshold, fsd.mode)
    return accept(tree, choice, blocked, TARGET, DIV).tokens


def test_without_guards_the_rule_accepts_the_top_ranked_children():
    assert step_tokens(FsdConfig(threshold=0.3), logits_with({})) == [10, 98]


@pytest.mark.parametrize("mode", ["reducible", "original"])
def test_a_stop_token_of_the_target_is_kept(mode):
    """Where the target's own choice is a stop token, its top-ranked child is not accepted fuzzily: the reply ends."""
    stop = torch.tensor([STOP])
    assert step_tokens(FsdConfig(threshold=0.3, mode=mode), logits_with({}), stop) == [10, 98]
    assert step_tokens(FsdConfig(threshold=0.3, mode=mode, keep_stop=True), logits_with({}), stop) == [STOP]
    other = torch.tensor([7])  # another stop token: the root stays open
    assert step_tokens(FsdConfig(threshold=0.3, mode=mode, keep_stop=True), logits_with({}), other) == [10, 98]


def test_a_draft_outside_the_targets_top_r_is_refused():
    """Root: three tokens score above the top-ranked child 10, so 10 is the target's 4th choice."""
    logits = logits_with({0: {STOP: 9.0, 1: 8.0, 2: 7.0, 10: 6.0}})
    assert step_tokens(FsdConfig(threshold=0.3, top_r=3), logits) == [STOP]
    assert step_tokens(FsdConfig(threshold=0.3, top_r=4), logits) == [10, 98]


def test_a_draft_beyond_the_margin_is_refused():
    logits = logits_with({0: {STOP: 9.0, 10: 6.5}})  # 10 is 2.5 nats below the target's best
    assert step_tokens(FsdConfig(threshold=0.3, margin=2.0), logits) == [STOP]
    assert step_tokens(FsdConfig(threshold=0.3, margin=3.0), logits) == [10, 98]


def test_a_confident_target_keeps_its_choice():
    """Root peaked on the stop token (entropy ~0.02 nats): closed under min_entropy 0.5; a flat target (entropy
    log V = 4.6 nats) stays open."""
    peaked = logits_with({0: {STOP: 12.0}})
    assert step_tokens(FsdConfig(threshold=0.3, min_entropy=0.5), peaked) == [STOP]
    assert step_tokens(FsdConfig(threshold=0.3, min_entropy=0.5), logits_with({})) == [10, 98]


def test_fuzzy_allowed_row_by_row():
    logits = torch.tensor([[5.0, 4.0, 0.0], [0.0, 0.0, 0.0], [9.0, 0.0, 8.5]])
    candidates, choice = torch.tensor([1, 2, 2]), torch.tensor([0, 2, 0])
    rank = fuzzy_allowed(logits, candidates, choice, FsdConfig(threshold=1.0, top_r=1), 3)
    assert rank.tolist() == [False, True, False]  # row 1: a three-way tie, nothing scores strictly above
    margin = fuzzy_allowed(logits, candidates, choice, FsdConfig(threshold=1.0, margin=0.6), 3)
    assert margin.tolist() == [False, True, True]
    entropy = fuzzy_allowed(logits, candidates, choice, FsdConfig(threshold=1.0, min_entropy=1.0), 3)
    assert entropy.tolist() == [False, True, False]  # log 3 = 1.10 > 1 on the flat row only
    stop = fuzzy_allowed(logits, candidates, choice, FsdConfig(threshold=1.0, keep_stop=True), 3, torch.tensor([2]))
    assert stop.tolist() == [True, False, True]
    none = fuzzy_allowed(logits, torch.tensor([-1, 1, 1]), choice, FsdConfig(threshold=1.0, top_r=3), 3)
    assert none.tolist() == [False, True, True]  # no candidate: nothing to accept


def test_bad_guard_settings_are_refused():
    for kwargs, name in ((dict(top_r=0), "fsd_top_r"), (dict(margin=-1.0), "fsd_margin"),
                         (dict(min_entropy=math.nan), "fsd_min_entropy")):
        with pytest.raises(ValueError, match=name):
            FsdConfig(threshold=1.0, **kwargs)


GUARDS = dict(keep_stop=True, top_r=2, margin=1.0, min_entropy=0.1)


def test_threshold_zero_with_every_guard_is_lossless():
    """T = 0: the engine's greedy output is the target's own, with all guards on."""
    target, drafter = tiny_model("llama", seed=1), LMDrafter(tiny_model("llama", seed=9), 1000)
    model = EaFsdModel(target, None, drafter, 8, 3, 2)
    ids = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(5))
    out = model.generate(ids, max_new_tokens=24, eos_token_id=[], fsd=FsdConfig(threshold=0.0, **GUARDS))
    assert torch.equal(out, hf_greedy(target, ids, 24))


def test_the_engine_keeps_the_targets_stop_token():
    """The reply's second token is decided at the first tree's root, where the prefix is still the target's own: let
    the target's choice there, greedy[1], be the stop token. With T = inf the drafter's top-ranked child replaces
    it and the reply runs on; keep_stop keeps it, and the reply ends there."""
    target, drafter = tiny_model("llama", seed=1), LMDrafter(tiny_model("llama", seed=9), 1000)
    model = EaFsdModel(target, None, drafter, 8, 3, 2)
    ids = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(5))
    greedy = hf_greedy(target, ids, 4)[0, 7:].tolist()
    stop = greedy[1]
    assert greedy[0] != stop
    loose = model.generate(ids, max_new_tokens=24, eos_token_id=[stop], fsd=FsdConfig(threshold=math.inf),
                           return_dict=True)
    kept = model.generate(ids, max_new_tokens=24, eos_token_id=[stop],
                          fsd=FsdConfig(threshold=math.inf, keep_stop=True), return_dict=True)
    loose_reply = loose.sequences[0, 7:].tolist()
    assert loose_reply[1] != stop and loose.fuzzy_mask[1]  # the drafter's token replaced the target's end
    assert kept.sequences[0, 7:].tolist() == [greedy[0], stop] and not any(kept.fuzzy_mask)


def test_the_vllm_chain_honours_the_guards():
    """vLLM rejected draft 0 (kept = [its replacement]); D is small everywhere, so the reducible rule keeps both
    drafts, unless a guard closes position 0 (the target's top choice there is a stop token)."""
    drafts = torch.tensor([3, 4])
    target_logits = torch.tensor([[0.0, 0.0, 5.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 5.0], [0.0, 5.0, 0.0, 0.0, 0.0]])
    probs = target_logits.softmax(-1)
    chain = DraftChain(drafts, target_logits[:2], probs[:2], probs[:2], None, probs[2], torch.tensor([2]))
    loose = fuzzy_chain([2], chain, FsdConfig(threshold=math.inf), greedy=True)
    assert loose == [3, 4, 1]
    assert fuzzy_chain([2], chain, FsdConfig(threshold=math.inf, keep_stop=True), greedy=True) == [2]
    assert fuzzy_chain([2], chain, FsdConfig(threshold=math.inf, top_r=1), greedy=True) == [2]
    assert fuzzy_chain([2], chain, FsdConfig(threshold=math.inf, top_r=2), greedy=True) == [3, 4, 1]


def test_guarded_rows_are_named_and_parsed_alike_in_bench_and_sweep():
    from eagle_fsd.eval import bench, sweep

    rows = bench.parse_fsd(["kl_qp+stop+r4:2,8", "tv:0.3"])
    assert [bench.fsd_row_name(r) for r in rows] == ["fsd kl_qp+stop+r4 T=2", "fsd kl_qp+stop+r4 T=8", "fsd tv T=0.3"]
    assert rows[0].keep_stop and rows[0].top_r == 4 and not rows[2].guarded
    arm, = sweep.parse_arm_spec("kl_qp+m1.5+h0.5:2")
    assert arm.label == "kl_qp+m1.5+h0.5 T=2" and (arm.fsd.margin, arm.fsd.min_entropy) == (1.5, 0.5)
    for bad in (["x1"], ["r"], ["mfast"]):
        with pytest.raises(SystemExit, match="guard"):
            sweep.parse_guards(bad)
