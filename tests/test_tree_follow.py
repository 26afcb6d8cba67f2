"""A draft tree per acceptance rule: the rescue-rate model over a cost profile, the per-rule replay's verdicts on
hand-built distributions, the online re-choice on synthetic acceptance streams, and exactness across a switch."""
import math
import random
from collections import defaultdict

import pytest
import torch

from eagle_fsd import tune
from eagle_fsd.drafting import LMDrafter
from eagle_fsd.fsd import FsdConfig
from eagle_fsd.model import EaFsdModel
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tune.follow import (ShapeFollower, best_shape, deeper_chains, fit_rescue, lossless_acceptance,
                                   predicted_speedup, rule_tau)
from eagle_fsd.tune.rule_replay import rescue_of, rule_verdicts
from tiny import WordTokenizer, hf_greedy, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHA = (0.7, 0.6, 0.5, 0.4)  # lossless P(depth L accepted | L - 1) on the calibration prompts


def chain_tau(levels: int, alpha=ALPHA) -> float:
    tau, survive = 1.0, 1.0
    for a in alpha[:levels]:
        survive *= a
        tau += survive
    return tau


def chain_profile() -> tune.CostProfile:
    """Chains (k = 1): d draft forwards grow d + 1 levels, a tree of n nodes holds min(d + 1, n - 1) of them;
    acceptance ALPHA; verification costs 11 ms per extra node. At f = 0 the trees (3, 1, 1) and (2, 1, 1) are
    near-tied (1.32 vs 1.30 x plain)."""
    tau = {(n, d, 1, 0): chain_tau(min(d + 1, n - 1)) for d in range(1, 4) for n in range(2, d + 3)}
    verify = {n: 30.0 + 11.0 * (n - 1) for n in range(1, 6)}
    return tune.CostProfile(verify, {(1, 0): 3.0}, {0: 2.0}, overhead_ms=1.0, plain_ms=36.0, tau=tau,
                            acceptance_by_depth={(1, 0): list(ALPHA)})


def test_zero_rescue_is_the_profiles_own_acceptance():
    profile = chain_profile()
    for shape, tau in profile.tau.items():
        assert rule_tau(lossless_acceptance(profile, shape), 0.0) == pytest.approx(tau, abs=1e-6)
        assert predicted_speedup(profile, shape, 0.0) == pytest.approx(profile.speedup(shape), abs=1e-6)
    assert lossless_acceptance(profile, (5, 3, 1, 0)) == pytest.approx(ALPHA, abs=1e-6)
    assert len(lossless_acceptance(profile, (2, 3, 1, 0))) == 1  # two nodes hold one draft, however deep the pool


def test_rescue_moves_every_depth_and_fits_back():
    alpha0 = list(ALPHA)
    # f = 0.5 halves every depth's rejections; f = -0.5 halves its acceptances
    assert rule_tau(alpha0, 0.5) == pytest.approx(1 + 0.85 + 0.85 * 0.8 + 0.85 * 0.8 * 0.75 + 0.85 * 0.8 * 0.75 * 0.7)
    assert rule_tau(alpha0, -0.5) == pytest.approx(1 + 0.35 + 0.35 * 0.3 + 0.35 * 0.3 * 0.25
                                                   + 0.35 * 0.3 * 0.25 * 0.2)
    assert rule_tau(alpha0, 1.0) == pytest.approx(5.0) and rule_tau(alpha0, -1.0) == pytest.approx(1.0)
    for f in (-0.7, -0.1, 0.0, 0.3, 0.9):
        assert fit_rescue(alpha0, rule_tau(alpha0, f) - 1) == pytest.approx(f, abs=1e-6)
    assert fit_rescue(alpha0, 4.0) == pytest.approx(1.0, abs=1e-6)  # every draft accepted


def test_the_rules_tree_deepens_with_its_rescue_rate():
    profile = chain_profile()
    assert best_shape(profile, 0.0, 0)[0] == tune.choose_shape(profile)[0]
    assert best_shape(profile, 0.8, 0)[0][1] > 1

    def every_draft_accepted(shape):  # f = 1: E[a + 1] = 1 + the levels the tree holds
        n, d, _, _ = shape
        return (1 + min(d + 1, n - 1)) * profile.plain_ms / profile.step_ms(shape)

    assert best_shape(profile, 1.0, 0)[0] == max(profile.tau, key=lambda s: (every_draft_accepted(s), -s[0]))


def test_chains_deeper_than_the_replay_are_candidates_at_the_deepest_rate():
    """The replay went to depth 3 (4 levels); verification is measured up to 12 nodes. A rule that accepts every
    draft is not capped at the replayed depth: the deepest chain allowed wins, and its acceptance beyond depth 4 is
    depth 4's. The lossless rule keeps a replayed tree."""
    profile = chain_profile()
    profile.verify_ms.update({n: 30.0 + 4.0 * (n - 1) for n in range(1, 13)})
    # up to twice the size of the deepest replayed chain (5 nodes): 10, though sizes 11 and 12 are measured
    assert deeper_chains(profile, 0) == [(6, 4, 1, 0), (7, 5, 1, 0), (8, 6, 1, 0), (9, 7, 1, 0), (10, 8, 1, 0)]
    assert lossless_acceptance(profile, (8, 6, 1, 0)) == pytest.approx(list(ALPHA) + [ALPHA[-1]] * 3, abs=1e-6)
    assert best_shape(profile, 1.0, 0)[0] == (10, 8, 1, 0)
    assert rule_tau(lossless_acceptance(profile, (10, 8, 1, 0)), 1.0) == pytest.approx(10.0)
    assert best_shape(profile, 0.0, 0)[0] in profile.tau
    assert ShapeFollower(profile, TreeShape(3, 1, 1)).room == TreeShape(10, 8, 1)


def chain_lengths(alpha, depth: int, steps: int, rng: random.Random) -> list[int]:
    """Accepted lengths of `steps` chain steps of `depth` drafts with per-depth acceptance `alpha`."""
    out = []
    for _ in range(steps):
        a = 0
        while a < depth and rng.random() < alpha[a]:
            a += 1
        out.append(a)
    return out


def test_follower_keeps_its_tree_on_noise_and_switches_when_the_stream_changes():
    """Lossless acceptance drawn at random: the near-tied choice holds (the margin absorbs the noise). Then the
    stream rescues 95 % of rejections: the follower moves to a deeper tree within a few checks."""
    profile = chain_profile()
    rng = random.Random(0)
    follower = ShapeFollower(profile, TreeShape(3, 1, 1))
    for a in chain_lengths(ALPHA, 2, 2000, rng):
        follower.record(a)
    assert follower.switches == 0 and follower.shape == TreeShape(3, 1, 1)
    rescued = [1 - (1 - a) * 0.05 for a in ALPHA]
    switched_at = None
    for i, a in enumerate(chain_lengths(rescued, 2, 200, rng)):
        if follower.record(a) and switched_at is None:
            switched_at = i
    assert switched_at is not None and switched_at < 100
    assert follower.shape.depth > 1 and 0.8 < follower.rescue <= 1.0


def context_profile() -> tune.CostProfile:
    """chain_profile timed at 256 cached tokens, each extra verified node 0.05 ms and a draft level 0.0125 ms cheaper
    per token fewer: at 56 tokens a node costs 1 ms more, a level 0.5 ms, and deeper chains pay."""
    profile = chain_profile()
    profile.context_tokens = 256
    profile.verify_slope = {n: 0.05 * (n - 1) for n in profile.verify_ms}
    profile.level_slope, profile.extend_slope = {(1, 0): 0.0125}, {0: 0.0}
    return profile


def test_follower_chooses_the_tree_for_the_calls_context():
    profile = context_profile()
    short, _ = best_shape(profile.at_context(56), 0.0, 0)
    at_timing = predicted_speedup(profile.at_context(56), (3, 1, 1, 0), 0.0)
    assert short != (3, 1, 1, 0) and predicted_speedup(profile.at_context(56), short, 0.0) > 1.05 * at_timing
    follower = ShapeFollower(profile, TreeShape(3, 1, 1))  # the best tree at the timing context
    assert not follower.at_context(250)  # a context near the timing one: within the margin, kept
    assert follower.at_context(56) and follower.shape == TreeShape(*short[:3]) and follower.switches == 1
    assert follower.at_context(256) and follower.shape == TreeShape(3, 1, 1)  # back where the costs were timed
    assert not ShapeFollower(None, TreeShape(3, 1, 1)).at_context(56)  # a fixed tree stays


def test_lossless_output_is_unchanged_by_a_switch_for_the_context():
    """A short prompt and a short reply run at a context where deeper chains pay: the call starts on another tree
    (counted as a switch) and its output is still the target's greedy output."""
    model = tuned_tiny(context_profile(), shape=(3, 1, 1, 0))
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(4))
    out = model.generate(ids, max_new_tokens=30, eos_token_id=[], return_dict=True)
    assert out.tree_switches >= 1 and "3/1/1" not in out.tree_steps
    assert torch.equal(out.sequences, hf_greedy(model.base_model, ids, 30))


def test_rule_verdicts_on_hand_built_distributions():
    """Four positions of a 6-token vocabulary (token 5 is the stop token): 0 the drafter agrees; 1 it disagrees
    but is close; 2 it disagrees far off; 3 it disagrees where the target's own choice is the stop token."""
    target = torch.tensor([[4.0, 0, 0, 0, 0, 0], [2.0, 1.9, 0, 0, 0, 0], [3.0, 0, 0, 0, 0, 0],
                           [0, 1.9, 0, 0, 0, 2.0]])
    draft = torch.log_softmax(torch.tensor([[3.0, 0, 0, 0, 0, 0], [1.9, 2.0, 0, 0, 0, 0], [0, 0, 0, 0, 3.0, 0],
                                            [0, 2.0, 0, 0, 0, 1.9]]), -1)
    stop = torch.tensor([5])
    lossless, rule = rule_verdicts(target, draft, FsdConfig(threshold=0.1), 6, stop)
    assert lossless.tolist() == [True, False, False, False]
    assert rule.tolist() == [True, True, False, True]
    _, kept = rule_verdicts(target, draft, FsdConfig(threshold=0.1, keep_stop=True), 6, stop)
    assert kept.tolist() == [True, True, False, False]
    _, exact = rule_verdicts(target, draft, FsdConfig(threshold=0.0), 6, stop)
    assert exact.tolist() == lossless.tolist()  # T = 0: lossless
    _, original = rule_verdicts(target, draft, FsdConfig(threshold=1e-4, mode="original"), 6, stop)
    assert original.tolist() == [False, False, False, False]  # the paper's rule blocks a match above T
    assert rescue_of(lossless, rule) == pytest.approx((0.75 - 0.25) / 0.75)
    assert rescue_of(lossless, original) == pytest.approx(-1.0)
    assert rescue_of(lossless, lossless) == 0.0


def tuned_tiny(profile: tune.CostProfile, shape=(5, 3, 1, 0), drafter_seed: int = 2) -> EaFsdModel:
    target = tiny_model("llama", seed=1)
    # the speed guard's yardstick: plain decoding at 10 s a token, so that it never falls back here
    tuning = tune.Tuning(shape=shape, predicted_speedup=1.5, plain_ms=1e4, verify_ms={1: 1.0}, speculate=True,
                         profile=profile)
    return EaFsdModel(target, WordTokenizer(), LMDrafter(tiny_model("llama", seed=drafter_seed), 1000), *shape[:3],
                      tuning=tuning)


def test_lossless_output_is_unchanged_by_a_switch():
    """A drafter with the target's weights accepts every draft, far above the profile's acceptance: the lossless
    rule's tree moves from the shallow chain to the deepest during the call, and the output is still the target's
    greedy output."""
    model = tuned_tiny(chain_profile(), shape=(2, 1, 1, 0), drafter_seed=1)
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(4))
    out = model.generate(ids, max_new_tokens=120, eos_token_id=[], return_dict=True)
    assert out.tree_switches >= 1 and set(out.tree_steps) >= {"2/1/1", "5/3/1"}
    assert torch.equal(out.sequences, hf_greedy(model.base_model, ids, 120))
    assert model.trees_for(None).shape == TreeShape(5, 3, 1)  # kept for the model's next lossless call


def test_an_fsd_rules_first_tree_comes_from_its_replay():
    """T = inf accepts wherever the drafter proposes: rescue 1, the deepest chain. T = 0 is lossless: rescue 0, the
    lossless tree. The replay reads the profile's calibration sequences (here the target's own continuation)."""
    profile = chain_profile()
    model = tuned_tiny(profile, shape=(3, 1, 1, 0))  # the cost model's choice at f = 0
    prompt = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(5))
    profile.calibration = [[hf_greedy(model.base_model, prompt, 24)[0].tolist(), 7]]
    wide = model.trees_for(FsdConfig(threshold=math.inf))
    assert wide.rescue == pytest.approx(1.0) and wide.shape == TreeShape(5, 3, 1)
    exact = model.trees_for(FsdConfig(threshold=0.0))
    assert exact.rescue == 0.0 and exact.shape == TreeShape(3, 1, 1)
    assert model.plan.tree_for(FsdConfig(threshold=math.inf)) == TreeShape(5, 3, 1)


def test_bench_prints_each_rules_first_tree_and_its_prediction():
    from eagle_fsd.eval import bench

    profile = chain_profile()
    model = tuned_tiny(profile, shape=(3, 1, 1, 0))  # the cost model's choice at f = 0
    prompt = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(5))
    profile.calibration = [[hf_greedy(model.base_model, prompt, 24)[0].tolist(), 7]]
    job = bench.BenchJob(settings=None, fsd_rows=[FsdConfig(threshold=math.inf)])
    predictions = bench.rule_predictions(model, job)
    lossless, fuzzy = predictions["eagle-fsd"], predictions["fsd kl_qp T=inf"]
    assert lossless["first_tree"] == "3/1/1" and lossless["rescue"] == 0.0
    assert lossless["speedup_per_token"] == pytest.approx(profile.speedup((3, 1, 1, 0)), abs=1e-3)
    assert fuzzy["first_tree"] == "5/3/1" and fuzzy["tau"] == pytest.approx(5.0)
    # two answers each; plain: 41 tokens in 40 steps after the prefills, 2 s of steps (50 ms a token); the rule: 41
    # tokens in 8 steps, 0.5 s (verify 0.3 s): 4x plain per new token, E[a + 1] 5 per step
    totals = {"plain": {"tokens": 42, "seconds": 4.2, "steps": 40, "fuzzy": 0, "accepted": 0, "tree_switches": 0,
                        "phase_verify": 1.8, "phase_other": 0.2},
              "fsd kl_qp T=inf": {"tokens": 42, "seconds": 2.1, "steps": 8, "fuzzy": 8, "accepted": 32,
                                  "tree_switches": 1, "phase_draft_prefill": 0.4, "phase_verify": 0.3,
                                  "phase_draft": 0.15, "phase_accept": 0.05, "tree 5/3/1": 6, "tree 3/1/1": 2}}
    totals = {k: defaultdict(float, v) for k, v in {"hf-generate": {"tokens": 42, "seconds": 8.4}, **totals}.items()}
    rows = bench.summarize_rows(totals, {k: [1.0, 1.0] for k in totals}, 2)
    result = {"rows": rows}
    bench.add_predictions(result, predictions, profile)
    row = result["rows"][2]
    assert row["measured_over_plain"] == 2.0 and row["prediction"] == fuzzy
    assert row["ms_per_token_after_prefill"] == pytest.approx(12.5) and row["tokens_per_step"] == pytest.approx(5.0)
    assert row["step_ms"] == {"verify": 37.5, "drafting": 25.0}
    assert row["measured_over_plain_per_token"] == pytest.approx(4.0)
    assert row["prediction_error"] == pytest.approx(fuzzy["speedup_per_token"] / 4.0 - 1, abs=1e-3)
    # on the trees it ran, at the replayed f = 1: 6 steps of (5, 3, 1) (E[a + 1] 5, t_step 74 + 3 * 3 + 2 + 1 = 86 ms)
    # and 2 of (3, 1, 1) (E[a + 1] 3, t_step 52 + 3 + 2 + 1 = 58 ms): 36 tokens in 632 ms, t_plain 36 ms
    assert row["prediction_on_trees_run"] == pytest.approx(36 * 36.0 / 632, abs=1e-3)
    assert row["prediction_error_on_trees_run"] == pytest.approx(36 * 36.0 / 632 / 4.0 - 1, abs=1e-3)
    # 5 tokens a step is beyond those trees' reach (at most 4.5): the acceptance measured is taken as f = 1
    assert row["rescue_measured"] == pytest.approx(1.0, abs=1e-3)
    assert row["prediction_at_measured_acceptance"] == row["prediction_on_trees_run"]


def test_the_acceptance_a_row_measured_fits_back_over_the_trees_it_ran():
    """6 steps on (5, 3, 1) and 2 on (3, 1, 1) at f: their step-weighted E[a + 1] fits back to f, and with it the
    prediction is the measured speedup wherever the costs hold."""
    from eagle_fsd.tune.follow import fit_rescue_on_trees, trees_run_speedup

    profile = chain_profile()
    steps = {(5, 3, 1, 0): 6, (3, 1, 1, 0): 2}
    for f in (-0.3, 0.0, 0.4, 0.8):
        tokens_per_step = (6 * rule_tau(list(ALPHA), f) + 2 * rule_tau(list(ALPHA[:2]), f)) / 8
        assert fit_rescue_on_trees(profile, steps, tokens_per_step) == pytest.approx(f, abs=1e-6)
        step_ms = (6 * 86 + 2 * 58) / 8  # t_step of each tree (chain_profile)
        measured = tokens_per_step * profile.plain_ms / step_ms
        assert trees_run_speedup(profile, steps, f) == pytest.approx(measured, rel=1e-6)
        # 4 more steps decoded plainly by the speed guard: one token at t_plain each
        with_plain = (8 * tokens_per_step + 4) * 36.0 / (8 * step_ms + 4 * 36.0)
        assert trees_run_speedup(profile, steps, f, plain_steps=4) == pytest.approx(with_plain, rel=1e-6)


def test_bench_predicts_at_the_runs_mean_context():
    """The bench's prompts and new tokens set the context its steps run at (mean prompt + half the new tokens); its
    predictions take the costs there."""
    from eagle_fsd.eval import bench

    profile = context_profile()
    model = tuned_tiny(profile, shape=(3, 1, 1, 0))
    assert bench.mean_context([torch.zeros(1, 7), torch.zeros(1, 9)], 40) == 28.0
    job = bench.BenchJob(settings=None, fsd_rows=[])
    at_timing = bench.rule_predictions(model, job)["eagle-fsd"]
    at_56 = bench.rule_predictions(model, job, 56)["eagle-fsd"]
    assert at_timing["verify_ms"] == pytest.approx(profile.verify_ms[3])
    assert at_56["verify_ms"] == pytest.approx(profile.verify_ms[3] - 200 * 0.1)
    assert at_56["step_ms"] == pytest.approx(at_timing["step_ms"] - 20 - 2.5)


def test_the_benchs_whole_run_prediction_takes_the_costs_at_its_context():
    """The headline prediction (whole generations: prompts prefilled, then the new tokens) is the lossless rule's
    first tree with the costs at the run's mean context, as the rule's own line, not the tuned choice as loaded."""
    from eagle_fsd.eval import bench
    from eagle_fsd.settings import ModelSettings, Settings
    from eagle_fsd.tune.profile import workload_speedup

    profile = context_profile()
    profile.prefill_ms, profile.draft_prefill_ms = 2.0, 0.5
    model = tuned_tiny(profile, shape=(3, 1, 1, 0))
    totals = {name: defaultdict(float, {"tokens": 40, "seconds": s}) for name, s in
              (("hf-generate", 8.0), ("plain", 2.0), ("eagle-fsd", 1.0))}
    ids_list = [torch.zeros(1, 7, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long)]
    settings = Settings(model=ModelSettings(model="tiny"))
    at_56 = profile.at_context(56)
    result = bench.summarize(model, settings, ids_list, totals, {k: [1.0, 1.0] for k in totals}, at_56,
                             TreeShape(3, 1, 1, 0))
    step = at_56.step_ms((3, 1, 1, 0))
    expected = workload_speedup(2.0, 0.5, profile.plain_ms, step / profile.tau[(3, 1, 1, 0)], 16, 40)
    assert result["predicted_speedup_over_plain"] == pytest.approx(expected, abs=1e-3)
    assert result["predicted_speedup_over_plain_per_token"] == pytest.approx(at_56.speedup((3, 1, 1, 0)), abs=1e-3)
    assert at_56.speedup((3, 1, 1, 0)) > profile.speedup((3, 1, 1, 0)) + 0.01  # the context moved it
    assert result["measured_speedup_over_plain"] == 2.0
