"""The cost model and its choices: the argmax of the formula, the exact replay of acceptance, the speed guard,
plain decoding when speculation cannot pay, dtype "auto", and reduced draft vocabularies."""
import itertools
import json
import time

import pytest
import torch

from eagle_fsd import tune, vocab
from eagle_fsd.tune import dtype as tune_dtype
from eagle_fsd.drafting import LMDrafter
from eagle_fsd.fsd import FsdConfig, node_divergences
from eagle_fsd.guard import GuardMemory
from eagle_fsd.model import EaFsdModel, SpeedGuard
from eagle_fsd.tree.accept import accept
from eagle_fsd.tree.dynamic import DraftPool, grow_pool, select_tree
from eagle_fsd.tree.shape import TreeShape
from tiny import WordTokenizer, hf_greedy, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- the formula
def synthetic_profile(seed=0) -> tune.CostProfile:
    gen = torch.Generator().manual_seed(seed)
    sizes, ks, depths, vocabs = (2, 4, 8, 16, 32), (1, 2, 4), (1, 2, 3, 4), (0, 4096)
    verify = {n: 30.0 * (1 + 0.05 * n) + float(torch.rand(1, generator=gen)) * 5 for n in sizes}
    level = {(k, v): (6.0 if v == 0 else 2.0) * (1 + 0.2 * k) for k in ks for v in vocabs}
    extend = {0: 6.0, 4096: 2.5}
    tau = {(n, d, k, v): 1 + float(torch.rand(1, generator=gen)) * min(n - 1, d + 1) * 0.8
           for n, d, k, v in itertools.product(sizes, depths, ks, vocabs)}
    return tune.CostProfile(verify, level, extend, overhead_ms=1.5, plain_ms=32.0, tau=tau)


@pytest.mark.parametrize("seed", range(5))
def test_choice_is_the_argmax_of_the_formula(seed):
    profile = synthetic_profile(seed)

    def predicted(n, d, k, v):  # the README's formula, written out independently
        step = profile.verify_ms[n] + d * profile.level_ms[(k, v)] + profile.extend_ms[v] + profile.overhead_ms
        return profile.tau[(n, d, k, v)] * profile.plain_ms / step

    best = max(profile.tau, key=lambda s: predicted(*s))
    shape, speedup = tune.choose_shape(profile)
    assert shape == best and speedup == pytest.approx(predicted(*best))
    # fixed values restrict the search; the rest stays an argmax
    shape, _ = tune.choose_shape(profile, depth=2)
    assert shape == max((s for s in profile.tau if s[1] == 2), key=lambda s: predicted(*s))
    with pytest.raises(ValueError, match="no measured tree shape"):
        tune.choose_shape(profile, total_token=7)


def test_profile_json_round_trip_and_plain_verdict():
    profile = synthetic_profile(1)
    again = tune.CostProfile.from_json(json.loads(json.dumps(profile.to_json())))
    assert again == profile
    slow = tune.CostProfile({2: 50.0}, {(1, 0): 20.0}, {0: 20.0}, 0.0, 30.0, {(2, 1, 1, 0): 1.2})
    tuning = tune.tuning_from(slow, {})
    assert not tuning.speculate and tuning.predicted_speedup == pytest.approx(1.2 * 30 / 90)


def test_costs_move_linearly_with_the_context():
    """Costs timed at two contexts, 64 and 256 cached tokens: at L every cost is t(256) + s (L - 256), t_plain moves
    with t_verify(1), and the profile keeps its slopes through JSON."""
    profile = synthetic_profile(2)
    assert profile.at_context(100) is profile  # timed at one context: nothing to move
    short = {n: ms - 0.01 * n * 192 for n, ms in profile.verify_ms.items()}  # as timed at 64 tokens
    profile.verify_ms[1], short[1] = 31.0, 29.08
    profile.context_tokens = 256
    profile.verify_slope = {n: (profile.verify_ms[n] - short[n]) / 192 for n in profile.verify_ms}
    profile.level_slope = {key: 0.004 for key in profile.level_ms}
    profile.extend_slope = {0: 0.002, 4096: 0.0}
    at = profile.at_context(64)
    assert at.verify_ms == pytest.approx(short) and at.context_tokens == 64
    assert at.plain_ms == pytest.approx(profile.plain_ms - 1.92)
    assert at.level_ms[(2, 0)] == pytest.approx(profile.level_ms[(2, 0)] - 0.768)
    assert at.extend_ms == pytest.approx({0: 6.0 - 0.384, 4096: 2.5})
    longer = profile.at_context(512)  # beyond the timings: the same line
    assert longer.verify_ms[32] == pytest.approx(profile.verify_ms[32] + 0.32 * 256)
    assert at.tau is profile.tau and at.overhead_ms == profile.overhead_ms
    assert tune.CostProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile


def test_workload_speedup_adds_the_prefills():
    """(P t_prefill + N t_plain) / (P (t_prefill + t_draft_prefill) + N t_step / tau), written out; with no prompt
    it is the per-token prediction, and the drafter's prefill only ever lowers it."""
    profile = synthetic_profile(2)
    profile.prefill_ms, profile.draft_prefill_ms = 3.0, 1.0
    shape, per_token = tune.choose_shape(profile)
    step = profile.step_ms(shape)
    want = (150 * 3.0 + 128 * 32.0) / (150 * 4.0 + 128 * step / profile.tau[shape])
    assert profile.workload_speedup(shape, 150, 128) == pytest.approx(want)
    assert profile.workload_speedup(shape, 0, 128) == pytest.approx(per_token)
    tuning = tune.tuning_from(profile, {})
    assert tuning.workload_speedup(150, 128) == pytest.approx(want)
    profile.draft_prefill_ms = 0.0
    assert profile.workload_speedup(shape, 150, 128) > want


# ----------------------------------------------------------------------------- replay
def random_pool(k, levels, vocab_size, gen):
    """A pool grown by grow_pool from random draft logits (a stand-in drafter)."""
    def forward_level(tokens, states, level, mask):
        return torch.randn(tokens.numel(), vocab_size, generator=gen) * 3, None
    return grow_pool(forward_level, torch.randn(vocab_size, generator=gen) * 3, None, levels, k)


@pytest.mark.parametrize("k,levels", [(1, 4), (2, 3), (3, 3), (4, 2)])
def test_accepted_lengths_equal_select_tree_then_accept(k, levels):
    """Every (size, depth) read off one pool equals building that tree and walking it with the target's choices."""
    gen = torch.Generator().manual_seed(10 * k + levels)
    sizes = (2, 3, 4, 6, 9, 14, 30)
    for _ in range(30):
        pool = random_pool(k, levels, 6, gen)  # tiny vocab: long matches are common
        continuation = torch.randint(0, 6, (levels + 1,), generator=gen).tolist()
        got = tune.accepted_lengths(pool, continuation, sizes, range(1, levels + 1))
        for (n, d), a in got.items():
            tree = select_tree(torch.tensor(0), pool.first_levels(d + 1), n, d + 1)
            # greedy target: after the path to node i it emits continuation[depth(i)]
            choice = torch.tensor([continuation[int(x)] if x < len(continuation) else -1 for x in tree.depths])
            assert accept(tree, choice).accept_length == a, (n, d)


def test_tau_pools_steps_over_prompts_and_skips_a_prompt_without_positions():
    """E[a + 1] of a workload is its tokens over its steps: a prompt the drafter reads perfectly (a = 2 everywhere,
    3 tokens a step) and one it never reads (1 token a step), 12 positions each, take 4 + 12 steps for 24 tokens:
    1.5, not the prompts' mean 2.0. A prompt answered too briefly to replay (no rows) neither counts nor hides
    the others."""
    key, continuation = (3, 1, 1), list(range(20))
    perfect, never = [{key: 2}] * 12, [{key: 0}] * 12
    tau, _ = tune.tau_by_shape([[], perfect, never], [continuation[:3], continuation, continuation], {0: None}, (1,), 1)
    assert tau == {(3, 1, 1, 0): 24 / 16}
    assert tune.walk(perfect, key) == (12, 4) and tune.walk(never, key) == (12, 12)


def test_the_tuner_reads_every_shipped_calibration_prompt():
    """The default settings replay all of eagle_fsd/calibration.json, prompts of many kinds of request: the
    E[a + 1] of a few swings with which ones they are."""
    from eagle_fsd.tune.measure import CALIBRATION_FILE

    shipped = json.loads(CALIBRATION_FILE.read_text())["prompts"]
    assert tune.TuneSettings().prompts == len(shipped) >= 12 and len(set(shipped)) == len(shipped)


def noisy_copy(model, scale, seed):
    torch.manual_seed(seed)
    copy = tiny_model("llama", seed=1)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(scale * torch.randn_like(p))
    return copy


@pytest.mark.parametrize("shape", [(6, 3, 2), (4, 2, 1), (10, 2, 3)])
def test_replay_predicts_the_engine_step_by_step(shape):
    """Greedy replay is exact: its walk gives the accept length of every step the engine takes."""
    n, d, k = shape
    target = tiny_model("llama", seed=1)
    model = EaFsdModel(target, None, LMDrafter(noisy_copy(target, 0.003, seed=5), 1000), n, d, k)
    prompt = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(3))
    out = model.generate(prompt[None], max_new_tokens=40, eos_token_id=[], return_dict=True)
    continuation = out.sequences[0, 12:]
    rows, _ = tune.replay(model, prompt, continuation, (k,), d, (n,))
    walk, j = [], 0
    while j < len(rows):
        walk.append(rows[j][(n, d, k)])
        j += walk[-1] + 1
    assert 0 < sum(walk) and walk == out.accept_lengths[: len(walk)]


# ----------------------------------------------------------------------------- never slower than plain
def test_speed_guard_backs_off_and_retries():
    # profile: plain 100 ms/token, verifying 4 tokens 150 ms
    guard = SpeedGuard(plain_ms=100.0, verify_ms={1: 100.0, 4: 150.0}, window=4, backoff=8)
    for _ in range(4):
        assert guard.speculate()
        guard.record(True, tokens=2, seconds=0.25, verify_seconds=0.15, tree_size=4)  # 8 tok/s < plain's 10
    assert not guard.speculate()
    for _ in range(8):
        guard.record(False, tokens=1, seconds=0.1)
    assert guard.speculate() and guard.backoff == 16  # re-tried, with a longer backoff next time
    for _ in range(4):
        guard.record(True, tokens=3, seconds=0.2, verify_seconds=0.15, tree_size=4)  # 15 tok/s: keeps going
    assert guard.speculate()
    assert SpeedGuard(None).speculate()  # no profile: no guard


def test_speed_guard_rides_out_a_short_stretch_of_low_acceptance_and_stops_a_lasting_one():
    """With its default window (32 speculative steps), 16 losing steps amid steps that pay (a list of names in a
    reply) do not switch speculation off; a lasting stretch does, within 32 steps."""
    guard = SpeedGuard(plain_ms=100.0, verify_ms={1: 100.0, 4: 100.0})
    paying, losing = dict(tokens=2, seconds=0.15, verify_seconds=0.1, tree_size=4), \
        dict(tokens=1, seconds=0.15, verify_seconds=0.1, tree_size=4)  # 13.3 and 6.7 tok/s against plain's 10
    for step in range(48):
        assert guard.speculate(), step
        guard.record(True, **(losing if 16 <= step < 32 else paying))
    steps = 0
    while guard.speculate() and steps < 32:  # the window's paying steps leave it one by one
        guard.record(True, **losing)
        steps += 1
    assert not guard.speculate() and 16 < steps < 32, steps


def test_speed_guard_judges_by_the_machine_speed_now():
    """A machine running 2x slower than when tuned slows plain decoding too: the same steps still pay."""
    guard = SpeedGuard(plain_ms=100.0, verify_ms={1: 100.0, 4: 150.0}, window=4)
    for _ in range(4):  # 2 tokens in 0.4 s = 5 tok/s, but verification took 2x its profiled time
        guard.record(True, tokens=2, seconds=0.4, verify_seconds=0.3, tree_size=4)
    assert guard.speculate()
    for _ in range(4):  # at the profiled speed the same steps lose
        guard.record(True, tokens=2, seconds=0.4, verify_seconds=0.15, tree_size=4)
    assert not guard.speculate()


def test_guard_heals_a_verify_ratio_that_the_profile_put_low():
    """The profile says verifying 4 tokens costs 1.3x one (130 vs 100 ms); on the machine it costs 1.6x (160 ms).
    Speculative steps of 2.5 tokens in 0.27 s lose 8 % to plain's 0.1 s a token, which the profile's ratio would
    hide (it prices those 2.5 plain tokens at 0.31 s); the measured ratio shows it."""
    guard = SpeedGuard(plain_ms=100.0, verify_ms={1: 100.0, 4: 130.0}, window=16, backoff=8, start_plain=True)
    for _ in range(8):
        assert not guard.speculate()
        guard.record(False, tokens=1, seconds=0.1, verify_seconds=0.1, tree_size=1)
    assert guard.verify_reference_ms(4) == pytest.approx(130.0)  # no speculative step seen yet: the profile's
    for step in range(16):
        assert guard.speculate(), step
        guard.record(True, tokens=2.5, seconds=0.27, verify_seconds=0.16, tree_size=4)
    assert guard.verify_reference_ms(4) == pytest.approx(160.0)
    assert not guard.speculate()


def test_guards_share_measurements_and_losses_in_a_row_double_the_backoff_up_to_a_cap():
    memory = GuardMemory()
    lossless = SpeedGuard(plain_ms=100.0, verify_ms={1: 100.0, 4: 150.0}, window=4, backoff=8, memory=memory)
    backoffs = []
    for _ in range(12):  # 2 tokens in 0.25 s against plain's 0.2 s: a loss each window
        for _ in range(4):
            assert lossless.speculate()
            lossless.record(True, tokens=2, seconds=0.25, verify_seconds=0.15, tree_size=4)
        backoffs.append(lossless.plain_left)
        while not lossless.speculate():
            lossless.record(False, tokens=1, seconds=0.1, verify_seconds=0.1, tree_size=1)
    assert backoffs == [8, 16, 32, 64, 128, 256, 512, 1024, 1024, 1024, 1024, 1024]
    fuzzy = SpeedGuard(plain_ms=100.0, verify_ms={1: 100.0, 4: 150.0}, window=4, backoff=8, memory=memory)
    assert fuzzy.plain_seen is lossless.plain_seen and len(fuzzy.plain_seen) == 64  # the plain rate, measured
    assert fuzzy.verify_reference_ms(4) == pytest.approx(150.0)  # the ratio measured, 0.15 s / 0.1 s
    for _ in range(4):  # one losing window, its plain backoff, then 3 tokens in 0.2 s: this one pays
        fuzzy.record(True, tokens=2, seconds=0.25, verify_seconds=0.15, tree_size=4)
    assert fuzzy.backoff == 16
    for _ in range(8):
        fuzzy.record(False, tokens=1, seconds=0.1, verify_seconds=0.1, tree_size=1)
    for _ in range(4):
        fuzzy.record(True, tokens=3, seconds=0.2, verify_seconds=0.15, tree_size=4)
    assert fuzzy.speculate() and fuzzy.backoff == 8  # a paying window ends the run of losses


def test_a_models_calls_under_one_rule_are_judged_as_one_generation():
    """A tuning whose t_plain is a millionth of a verify: every speculative window loses. The first call ends inside
    its plain backoff; the second lossless call finishes that backoff, so it decodes plainly from its first token;
    an FSD call has its own guard, which has not lost yet, so it speculates."""
    target = tiny_model("llama", seed=1)
    tuning = tune.Tuning(shape=(4, 1, 1, 0), predicted_speedup=1.2, plain_ms=1e-4, verify_ms={1: 100.0, 4: 120.0},
                         speculate=True)
    model = EaFsdModel(target, WordTokenizer(), LMDrafter(tiny_model("llama", seed=2), 1000),
                       4, 1, 1, tuning=tuning)
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(4))
    first = model.generate(ids, max_new_tokens=45, eos_token_id=[], return_dict=True)
    assert 0 < first.plain_steps < first.verify_steps  # speculated for a window, then fell back
    assert model._speed_guard(None).plain_left >= 10  # ... and ended inside the backoff
    prefills = []
    prefill = model.drafter.prefill
    model.drafter.prefill = lambda *args: prefills.append(1) or prefill(*args)
    second = model.generate(ids, max_new_tokens=10, eos_token_id=[], return_dict=True)
    assert second.plain_steps == second.verify_steps
    assert not prefills  # never drafting, the drafter never read the prompt
    assert torch.equal(second.sequences, hf_greedy(target, ids, 10))
    fuzzy = model.generate(ids, max_new_tokens=10, eos_token_id=[], return_dict=True, fsd_threshold=0.5)
    assert fuzzy.plain_steps < fuzzy.verify_steps and prefills == [1]
    # the FSD guard prices plain decoding with what the lossless calls' plain steps measured
    assert len(model._speed_guard(FsdConfig(threshold=0.5)).plain_seen) == first.plain_steps + second.plain_steps


def slow_prompt_read(model, seconds):
    """The drafter's prompt read made `seconds` slower (a long prompt)."""
    prefill = model.drafter.prefill
    model.drafter.prefill = lambda *args: time.sleep(seconds) or prefill(*args)


def test_the_drafters_prompt_read_is_its_own_phase_not_a_steps_cost():
    """The drafter reads the prompt at the first draft: timed as `draft_prefill`, left out of the step the guard
    judges (a long prompt must not look like a losing step) and out of the tuner's per-step overhead."""
    from eagle_fsd.tune.measure import measure_overhead

    target = tiny_model("llama", seed=1)
    tuning = tune.Tuning(shape=(4, 1, 1, 0), predicted_speedup=1.2, plain_ms=1e4, verify_ms={1: 1.0, 4: 1.2},
                         speculate=True)
    model = EaFsdModel(target, WordTokenizer(), LMDrafter(tiny_model("llama", seed=2), 1000),
                       4, 1, 1, tuning=tuning)
    slow_prompt_read(model, 0.3)
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(4))
    out = model.generate(ids, max_new_tokens=8, eos_token_id=[], return_dict=True)
    assert out.phase_seconds["draft_prefill"] >= 0.3
    steps = model._speed_guard(None).recent
    assert len(steps) == out.verify_steps and max(seconds for seconds, *_ in steps) < 0.3
    profile = tune.CostProfile(verify_ms={1: 1.0, 4: 1.0}, level_ms={(1, 0): 1.0}, extend_ms={0: 1.0},
                               overhead_ms=0.0, plain_ms=10.0, tau={(4, 1, 1, 0): 2.0})
    assert measure_overhead(model, ids[0], profile, new_tokens=8) < 0.3 * 1000 / 8 / 2


def test_hopeless_drafter_decodes_plainly_and_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_FSD_CACHE", str(tmp_path))
    target = tiny_model("llama", seed=1)
    hopeless = tiny_model("llama", seed=9, num_hidden_layers=6)  # random, and costlier than the target
    drafter = LMDrafter(hopeless, 1000)
    measured = EaFsdModel(target, WordTokenizer(), drafter, 8, 2, 2)
    settings = tune.TuneSettings(prompts=2, new_tokens=16, top_ks=(1, 2), max_depth=2, sizes=(2, 3, 4, 6, 8),
                                 rounds=2)
    tuning = tune.autotune(measured, "tiny-target", "tiny-hopeless", fixed={}, progress=False, settings=settings)
    assert not tuning.speculate and tuning.predicted_speedup < 1
    assert measured.shape == TreeShape(8, 2, 2) and measured.tuning is None  # measured, not changed
    model = EaFsdModel(target, WordTokenizer(), drafter, tuning=tuning)  # what the loader builds
    assert tuning.prefill_ms > 0 and tuning.draft_prefill_ms > 0  # both prefills timed per prompt token
    assert list(tmp_path.glob("tune/*.json"))  # cached as readable JSON
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(4))
    out = model.generate(ids, max_new_tokens=30, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 30))
    assert out.fell_back and out.plain_steps == out.verify_steps


def test_cache_key_separates_packed_kernels_and_cpu_caps(monkeypatch):
    """Profiles timed with other kernels or under an instruction-set cap are not reused."""
    from eagle_fsd.loading import plan_for
    from eagle_fsd.prepack import prepack_supported
    from eagle_fsd.tune.store import CPU_CAP_VARS
    from eagle_fsd.weights import PREPACKED, format_weights

    target, drafter = tiny_model("llama", seed=1), LMDrafter(tiny_model("llama", seed=2), 1000)
    model = EaFsdModel(target, None, drafter, 8, 3, 2)
    for name in CPU_CAP_VARS:
        monkeypatch.delenv(name, raising=False)
    plain = tune.cache_key(model, "m", "d")
    assert "cpu_caps" not in plain and "weights" not in plain["plan"]["target"]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = tune.cache_key(model, "m", "d")
    assert capped["cpu_caps"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert tune.cache_path(capped) != tune.cache_path(plain)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    if prepack_supported(torch.float32, "cpu"):
        format_weights(target, PREPACKED)
        packed_model = EaFsdModel(target, None, drafter, plan=plan_for(target, drafter, TreeShape(8, 3, 2),
                                                                       (PREPACKED, None)))
        packed = tune.cache_key(packed_model, "m", "d")
        assert packed["plan"]["target"]["weights"] == "prepacked" and tune.cache_path(packed) != tune.cache_path(plain)


def test_cache_key_separates_the_fused_decoder_forward():
    """A profile timed through transformers' forward is not reused for the fused one (eagle_fsd.fused_decoder)."""
    from eagle_fsd.fused_decoder import FUSED_VERSION, fused_fits

    model = EaFsdModel(tiny_model("llama", seed=1), None, LMDrafter(tiny_model("llama", seed=2), 1000), 8, 3, 2)
    fused = tune.cache_key(model, "m", "d")
    fits = fused_fits(model.base_model)
    assert fused["plan"]["target"].get("fused") == (True if fits else None)
    assert fused["plan"]["drafter"].get("fused") == (True if fits else None)
    assert fused.get("fused_version") == (FUSED_VERSION if fits else None)
    model.base_model.to(torch.bfloat16)
    model.drafter.model.to(torch.bfloat16)
    bf16 = EaFsdModel(model.base_model, None, model.drafter, 8, 3, 2)
    unfused = tune.cache_key(bf16, "m", "d")
    assert "fused" not in unfused["plan"]["target"] and tune.cache_path(unfused) != tune.cache_path(fused)


def test_cache_key_separates_the_int8_kernel(monkeypatch):
    """A profile timed with FBGEMM's int8 layers is not reused once they run eagle_fsd.kernels.int8_rows."""
    from eagle_fsd import target_quant
    from eagle_fsd.kernels.int8_rows import int8_rows_runnable
    from eagle_fsd.loading import plan_for
    from eagle_fsd.plan import WeightFormat
    from eagle_fsd.weights import format_weights

    if not (target_quant.row_int8_supported("cpu") and int8_rows_runnable(7)):
        pytest.skip("needs FBGEMM's int8 linear, AVX2 and a C++ compiler")
    monkeypatch.setattr(target_quant, "cpu_activation_bits", lambda: 7)  # the int8 layers of a CPU without VNNI
    keys = {}
    for avx2 in (False, True):
        monkeypatch.setattr(target_quant, "int8_rows_available", lambda bits: avx2)
        target, drafter = tiny_model("llama", seed=1), LMDrafter(tiny_model("llama", seed=2), 1000)
        rows = WeightFormat("rows")
        format_weights(target, rows)
        model = EaFsdModel(target, None, drafter, plan=plan_for(target, drafter, TreeShape(8, 3, 2), (rows, None)))
        keys[avx2] = tune.cache_key(model, "m", "d")
    assert keys[False]["plan"]["target"]["int8_kernel"] == "fbgemm"
    assert keys[True]["plan"]["target"]["int8_kernel"] == "int8_rows"
    assert tune.cache_path(keys[True]) != tune.cache_path(keys[False])


# ----------------------------------------------------------------------------- dtype "auto"
@pytest.mark.parametrize("packs, auto_kinds, on_kinds", [
    ({torch.float32, torch.bfloat16}, ("fp32", "fp32-packed", "bf16", "bf16-packed"), ("fp32-packed", "bf16-packed")),
    ({torch.float32}, ("fp32", "fp32-packed", "bf16"), ("fp32-packed", "bf16")),  # oneDNN without bf16 support
])
def test_dtype_auto_is_fp32_without_native_bf16(monkeypatch, packs, auto_kinds, on_kinds):
    monkeypatch.setattr(tune_dtype, "prepack_supported", lambda dtype, device: dtype in packs)
    monkeypatch.setattr(tune_dtype, "cpu_flags", lambda: {"avx2", "fma"})  # an AVX2-only CPU
    assert not tune.native_bf16()
    assert tune.resolve_dtype("auto") == torch.float32
    monkeypatch.setattr(tune_dtype, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    timed = []

    def fastest(winner):
        def pick(hidden, intermediate, kinds):
            timed.append(kinds)
            return next(k for k in kinds if k.startswith(winner))
        return pick

    monkeypatch.setattr(tune_dtype, "fastest_kind", fastest("bf16"))
    assert tune.resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(tune_dtype, "fastest_kind", fastest("fp32"))  # native, slower measured
    assert tune.resolve_dtype("auto") == torch.float32
    # each dtype is timed as it may run: plain and packed under "auto", packed only under "on", plain under "off"
    assert timed[-1] == auto_kinds
    tune.resolve_dtype("auto", prepack="on")
    assert timed[-1] == on_kinds
    tune.resolve_dtype("auto", prepack="off")
    assert timed[-1] == ("fp32", "bf16")
    assert tune.resolve_dtype(torch.float16) == torch.float16


# ----------------------------------------------------------------------------- reduced draft vocabulary
def test_reduced_draft_vocab_stays_lossless_and_drafts_inside_it():
    target = tiny_model("llama", seed=1)
    drafter = LMDrafter(noisy_copy(target, 0.003, seed=5), 1000)
    ids = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(2))
    greedy = hf_greedy(target, ids, 30)
    allowed = torch.sort(torch.unique(torch.cat([greedy[0, :20], torch.arange(0, 1000, 7)]))).values
    drafter.draft_head.set_draft_vocab(allowed)
    model = EaFsdModel(target, None, drafter, 10, 3, 3)
    out = model.generate(ids, max_new_tokens=30, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, greedy)
    assert out.tau > 1.2  # drafts inside the vocabulary still get accepted
    drafter.reset(64)
    logits, _ = drafter.prefill(ids[0], greedy[0, 10])
    assert logits.shape == (allowed.numel(),)
    pool = grow_pool(drafter.forward_level, logits, None, 2, 3, drafter.draft_vocab)
    assert torch.isin(pool.tokens, allowed).all()


def test_divergences_with_q_zero_outside_the_draft_vocab():
    """q is 0 outside the draft vocabulary: KL(q||p), JSD and TV stay finite, KL(p||q) is +inf (never fuzzy)."""
    gen = torch.Generator().manual_seed(0)
    draft_vocab = torch.arange(0, 50, 2)
    root = torch.tensor(3)
    pool = DraftPool(torch.tensor([4, 6]), torch.tensor([-0.1, -0.5]), torch.tensor([0, 0]), torch.tensor([1, 1]),
                     torch.tensor([0, -1, -1]), torch.randn(1, draft_vocab.numel(), generator=gen), draft_vocab)
    tree = select_tree(root, pool, 3, 1)
    target_logits = torch.randn(3, 50, generator=gen)
    full = tree.draft_logprobs_over(50)
    assert torch.isinf(full[0, 1::2]).all() and torch.isfinite(full[0, ::2]).all()
    for name, finite in (("kl_qp", True), ("jsd", True), ("tv", True), ("kl_pq", False)):
        d = node_divergences(tree, target_logits, FsdConfig(1.0, name), 50)
        assert torch.isfinite(d[0]) == finite and torch.isnan(d[1:]).all(), name


def test_frequency_tables_order_and_select():
    counts = torch.tensor([5, 0, 9, 5, 1])
    order = vocab.order_from_counts(counts)
    assert order.tolist() == [2, 0, 3, 4, 1]  # by count, ties by id
    assert vocab.draft_vocab(order, 3).tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        vocab.draft_vocab(order, 9)
    assert vocab.candidate_sizes(49152, cheap_drafter=True) == [12288, 6144]
    assert vocab.candidate_sizes(151936, cheap_drafter=False) == [37888]


def test_kernel_races_are_kept_per_machine_when_quiet(monkeypatch):
    """raced_ms times once and serves the kept result after (not when the machine was busy), apart per shape, kinds,
    rows and threads; forget_races (tune --force) drops them."""
    from eagle_fsd.tune import dtype as tune_dtype
    from eagle_fsd.tune.trust import TimingWatch
    from tiny import machine_clocks

    timed = []
    real = tune_dtype.mlp_kernel_ms

    def counting(*args, **kwargs):
        timed.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(tune_dtype, "mlp_kernel_ms", counting)
    busy_reason = TimingWatch.busy_reason
    monkeypatch.setattr(TimingWatch, "busy_reason", lambda self: None)  # quiet, whatever else runs beside the test
    first = tune_dtype.raced_ms(256, 1024, ("fp32",), rows=(1,))
    assert set(first) == {"fp32"} and len(timed) == 1
    assert tune_dtype.raced_ms(256, 1024, ("fp32",), rows=(1,)) == first and len(timed) == 1  # kept
    tune_dtype.raced_ms(256, 1024, ("fp32",), rows=(1, 2))  # other rows: timed
    tune_dtype.raced_ms(256, 512, ("fp32",), rows=(1,))  # another shape: timed
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        tune_dtype.raced_ms(256, 1024, ("fp32",), rows=(1,))  # other threads: timed
    finally:
        torch.set_num_threads(threads)
    assert len(timed) == 4
    tune_dtype.forget_races()
    assert not tune_dtype.race_path().exists()
    monkeypatch.setattr(TimingWatch, "busy_reason", busy_reason)
    monkeypatch.setattr(TimingWatch, "clocks", staticmethod(machine_clocks(0.3)))  # a busy machine
    tune_dtype.raced_ms(256, 1024, ("fp32",), rows=(1,))
    tune_dtype.raced_ms(256, 1024, ("fp32",), rows=(1,))
    assert len(timed) == 6 and not tune_dtype.race_path().exists()  # timed each time, never kept


MILAN_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma avx2 bmi2
processor\t: 1
cpu family\t: 25
model\t\t: 17
flags\t\t: avx512f avx512_vnni
"""


@pytest.mark.parametrize("flags, isa", [("avx fma avx2 bmi2", "avx2"), ("avx2 avx512f avx512bw", "avx512"),
                                        ("avx2 avx512f avx512_vnni avx512_bf16", "avx512_vnni"),
                                        ("avx2 avx512f avx512_vnni amx_bf16 amx_tile", "amx"), ("sse2", "")])
def test_cpu_class_names_family_model_and_widest_isa(flags, isa):
    info = f"processor\t: 0\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel Xeon\nflags\t\t: {flags}\n"
    assert tune.cpu_class(info) == "family 6 model 143" + (f", {isa}" if isa else "")


def test_cpu_class_reads_the_first_processor_and_survives_a_bare_cpuinfo():
    assert tune.cpu_class(MILAN_CPUINFO) == "family 25 model 1, avx2"  # not processor 1's model or flags
    assert tune.cpu_class("flags : avx2\n") == "avx2"
    assert tune.cpu_class("") == ""


def test_verify_costs_are_fitted_nondecreasing_in_the_tokens():
    """Pool adjacent violators: runs of timings that fall as n grows are replaced by their mean, the rest kept."""
    from eagle_fsd.tune.profile import nondecreasing

    assert nondecreasing({1: 37.0, 2: 34.0, 3: 34.0, 4: 40.0, 5: 39.0, 6: 45.0}) == \
        pytest.approx({1: 35.0, 2: 35.0, 3: 35.0, 4: 39.5, 5: 39.5, 6: 45.0})
    assert nondecreasing({1: 36.0, 2: 40.0, 3: 20.0}) == pytest.approx({1: 32.0, 2: 32.0, 3: 32.0})  # pooled twice
    rising = {1: 30.0, 2: 30.0, 4: 33.0, 8: 41.0}
    assert nondecreasing(rising) == rising
    assert nondecreasing({3: 5.0, 1: 9.0, 2: 7.0}) == pytest.approx({1: 7.0, 2: 7.0, 3: 7.0})  # keys sorted first
