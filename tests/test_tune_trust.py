"""Speed that survives a busy machine: tuning that notices other work on the CPU and does not cache what it timed
then, a cached profile checked at load and re-timed where it no longer holds, and a speed guard that takes t_plain
from the plain steps it runs. Timing conditions come from synthetic clocks (tiny.machine_clocks)."""
import json
from pathlib import Path

import pytest
import torch

from eagle_fsd import tune
from eagle_fsd.drafting import LMDrafter
from eagle_fsd.guard import SpeedGuard
from eagle_fsd.model import EaFsdModel
from eagle_fsd.tune.trust import TimingWatch, busy_reason, describe_age, relative_spread
from tiny import WordTokenizer, machine_clocks, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = tune.TuneSettings(prompts=2, new_tokens=16, top_ks=(1, 2), max_depth=2, sizes=(2, 3, 4, 6, 8), rounds=2,
                             retries=1, busy_wait=0.0)


def tiny_pair() -> EaFsdModel:
    target = tiny_model("llama", seed=1)
    return EaFsdModel(target, WordTokenizer(), LMDrafter(tiny_model("llama", seed=2, num_hidden_layers=1), 1000),
                      8, 2, 2)


def test_busy_reason_names_the_share_and_the_spread():
    assert relative_spread([1, 2, 3, 4, 5, 6, 7, 8]) == 1.0  # quartiles 2.25, 4.5, 6.75: (6.75 - 2.25) / 4.5
    assert relative_spread([5.0, 9.0, 1.0]) == 0.0  # too few rounds to judge
    assert busy_reason(0.97, 0.05) is None
    assert busy_reason(None, 0.05) is None  # not on a CPU: the share does not apply
    reason = busy_reason(0.5, 0.05, load=2.1)
    assert "50%" in reason and "load average 2.1" in reason
    assert "40%" in busy_reason(0.97, 0.4)
    assert (describe_age(30), describe_age(90), describe_age(3 * 3600 + 5), describe_age(2 * 86400)) == \
        ("under a minute", "1 minute", "3 hours", "2 days")


@pytest.mark.parametrize("share, busy", [(1.0, False), (0.9, False), (0.5, True)])
def test_watch_measures_our_share_of_the_cpu(monkeypatch, share, busy):
    monkeypatch.setattr(TimingWatch, "clocks", staticmethod(machine_clocks(share)))
    watch = TimingWatch(torch.get_num_threads())
    tune.timed_rounds({"work": lambda: torch.randn(64, 64) @ torch.randn(64, 64)}, 2, watch=watch)
    assert watch.cpu_share == pytest.approx(share)
    assert (watch.busy_reason() is not None) == busy
    assert watch.conditions()["busy"] == watch.busy_reason()


def test_profile_timed_on_a_busy_machine_is_used_but_not_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLE_FSD_CACHE", str(tmp_path))
    monkeypatch.setattr(TimingWatch, "clocks", staticmethod(machine_clocks(0.5)))
    model = tiny_pair()
    profile, path = tune.load_or_measure(model, "tiny", "tiny-drafter", settings=SETTINGS)
    err = capsys.readouterr().err
    assert "timing again" in err  # retried once (SETTINGS.retries) before giving up
    assert "not cached" in err and "--force" in err and "50%" in err
    assert "50%" in profile.conditions["busy"] and profile.verify_ms  # still a whole profile for this run
    assert not path.exists()
    tune.load_or_measure(model, "tiny", "tiny-drafter", settings=SETTINGS, force=True)  # `tune --force`
    assert "as --force asks" in capsys.readouterr().err
    assert json.loads(path.read_text())["profile"]["conditions"]["busy"]
    monkeypatch.setattr(TimingWatch, "clocks", staticmethod(machine_clocks(1.0)))
    quiet, _ = tune.load_or_measure(model, "tiny", "tiny-drafter", settings=SETTINGS, force=True)
    assert quiet.conditions["busy"] is None and quiet.conditions["cpu_share"] == 1.0
    assert json.loads(path.read_text())["profile"]["conditions"]["busy"] is None


def corrupt(path, factor: float) -> dict:
    """Multiply every cached t_verify(n) by `factor` (a profile that says verification costs more than it does)."""
    raw = json.loads(path.read_text())
    raw["profile"]["verify_ms"] = {n: t * factor for n, t in raw["profile"]["verify_ms"].items()}
    path.write_text(json.dumps(raw))
    return raw["profile"]["verify_ms"]


def test_cached_profile_is_checked_at_load_and_healed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLE_FSD_CACHE", str(tmp_path))
    model = tiny_pair()
    clean = tune.autotune(model, "tiny", "tiny-drafter", fixed={}, progress=False, settings=SETTINGS)
    path = Path(clean.path)
    corrupted = corrupt(path, 10.0)
    healed = tune.autotune(model, "tiny", "tiny-drafter", fixed={}, settings=SETTINGS)
    err = capsys.readouterr().err
    assert f"cost profile {path}, measured" in err and "ago" in err  # the profile in use and its age
    assert "re-timed" in err and "t_verify" in err
    cached = json.loads(path.read_text())["profile"]
    assert "t_verify" in cached["conditions"]["healed_from"]  # the correction persists
    for n, t in cached["verify_ms"].items():
        assert t < corrupted[n] / 3  # timed again, not the corrupted figure
    assert healed.verify_ms == {int(n): t for n, t in cached["verify_ms"].items()}

    corrupted = corrupt(path, 10.0)  # a busy machine at load: the profile is not judged by what it times then
    monkeypatch.setattr(TimingWatch, "clocks", staticmethod(machine_clocks(0.5)))
    tune.autotune(model, "tiny", "tiny-drafter", fixed={}, settings=SETTINGS)
    assert "not checked: the machine is busy now" in capsys.readouterr().err
    assert json.loads(path.read_text())["profile"]["verify_ms"] == corrupted


def test_profile_that_holds_is_kept():
    model = tiny_pair()
    profile = tune.measure(model, SETTINGS, progress=False)
    same, found = tune.check_costs(model, profile, margin=float("inf"), settings=SETTINGS)
    assert same is profile and "hold" in found


def test_costs_are_timed_at_two_contexts_and_checked_on_the_long_one(monkeypatch):
    """Attention over the cache grows with the context: the tuner times every cost on contexts of
    settings.timing_context and settings.short_context tokens (at most half the model's) and keeps the slope
    between them per cost; the target forwards of both contexts share one round-robin (a machine's drift between
    two passes would read as a slope); the check at load times on the long one."""
    import sys
    from dataclasses import replace

    tuner = sys.modules["eagle_fsd.tune.measure"]  # the module (eagle_fsd.tune.measure is also the function's name)

    model = tiny_pair()
    settings = replace(SETTINGS, timing_context=48, short_context=16, retries=0)  # one timing per context
    timed, rounds = [], []
    real, real_rounds = tuner.measure_costs, tuner.timed_rounds

    def spy(model, contexts, *args, **kwargs):
        costs = real(model, contexts, *args, **kwargs)
        timed.append(([c.numel() for c in contexts], costs))
        return costs

    def spy_rounds(fns, *args, **kwargs):
        rounds.append(set(fns))
        return real_rounds(fns, *args, **kwargs)

    monkeypatch.setattr(tuner, "measure_costs", spy)
    monkeypatch.setattr(tuner, "timed_rounds", spy_rounds)
    profile = tune.measure(model, settings, progress=False)
    [(at, (long_costs, short_costs))] = timed
    assert (at, profile.context_tokens) == ([48, 16], 48)
    assert {(i, n) for i in (0, 1) for n in profile.verify_ms} in rounds
    assert profile.verify_ms == long_costs[0]
    for slopes, long, short in zip((profile.verify_slope, profile.level_slope, profile.extend_slope), long_costs,
                                   short_costs):
        assert slopes == pytest.approx({key: (long[key] - short[key]) / 32 for key in long})
    tune.check_costs(model, profile, margin=float("inf"), settings=settings)
    assert [at for at, _ in timed[1:]] == [[48]]
    assert tuner.timing_context(model, replace(SETTINGS, timing_context=10_000)).numel() == 256  # 512 positions


def test_drafting_costs_are_read_on_the_target_passs_clock(monkeypatch):
    """The drafter's forwards are timed in a pass of their own, which times the target's one-token forward again: a
    drafting cost is its ratio to that forward in its pass, on the clock of the target's pass. Here the drafter's
    pass ran while the machine was slower (t_verify(1) 20 ms there, 12 in the target's pass): its 8 ms read as 4.8.
    One token timed slower than two is noise: both read as their mean."""
    import sys

    tuner = sys.modules["eagle_fsd.tune.measure"]
    passes = []

    def machine(fns, rounds, before=None, watch=None):
        passes.append(before)
        if "one token" in fns:  # the drafter's pass
            return {key: 20.0 if key == "one token" else 8.0 for key in fns}
        return {key: {1: 14.0, 2: 10.0, 4: 40.0}[key[1]] for key in fns}  # the target's pass

    monkeypatch.setattr(tuner, "timed_rounds", machine)
    [(verify, level, extend)] = tuner.measure_costs(tiny_pair(), [torch.arange(3, 27)], (1, 2, 4), (1, 2), {0: None},
                                                    1)
    assert verify == {1: 12.0, 2: 12.0, 4: 40.0}
    assert level == pytest.approx({(1, 0): 4.8, (2, 0): 4.8}) and extend == pytest.approx({0: 4.8})
    assert set(passes[1]) == {("level", 1), ("level", 2), "extend", "one token"}  # each key's own eviction


def test_timed_rounds_runs_each_keys_own_before():
    calls = []
    tune.timed_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2,
                      before={"a": lambda: calls.append("before a"), "b": None})
    assert calls == ["before a", "a", "b"] * 2


def test_guard_takes_t_plain_from_the_plain_steps_it_runs():
    """A profile that says verification costs 3x what it does (t_verify(1) 300 ms, the machine's 100 ms) and starts
    in plain decoding: the plain steps measure t_plain, and speculation that pays is kept when it is probed."""
    guard = SpeedGuard(plain_ms=100.0, verify_ms={1: 300.0, 4: 450.0}, window=4, backoff=8, start_plain=True)
    for _ in range(8):
        assert not guard.speculate()
        guard.record(False, tokens=1, seconds=0.1, verify_seconds=0.1, tree_size=1)  # 10 tok/s plain
    assert guard.speculate()
    assert guard.plain_seconds() == pytest.approx(0.3)  # 0.1 s at a third of the profile's verify time
    for _ in range(8):  # 2 tokens in 0.15 s = 13.3 tok/s, verify(4) at 150 ms
        guard.record(True, tokens=2, seconds=0.15, verify_seconds=0.15, tree_size=4)
        assert guard.speculate()
    for _ in range(4):  # 1 token in 0.15 s = 6.7 tok/s: slower than the plain steps measured
        guard.record(True, tokens=1, seconds=0.15, verify_seconds=0.15, tree_size=4)
    assert not guard.speculate()


def test_check_judges_costs_relative_to_plain_decoding():
    from eagle_fsd.tune.measure import disagreements

    cached = {"t_plain": 40.0, "t_verify(1)": 38.0, "t_verify(6)": 42.0, "t_level(4, full)": 6.0}
    slower = {name: 1.3 * t for name, t in cached.items()}  # the whole machine 30 % slower: every choice holds
    assert disagreements(cached, slower, 1.25) == (pytest.approx(1.3), [])
    corrupted = {**cached, "t_verify(1)": 38.0 / 3, "t_verify(6)": 42.0 / 3}  # cached verification x3, as issued
    assert disagreements(cached, corrupted, 1.25)[1] == ["t_verify(1)", "t_verify(6)"]
    plain_off = {**cached, "t_plain": 80.0}  # t_plain alone off: every other term disagrees with it
    assert disagreements(cached, plain_off, 1.25)[1] == ["t_verify(1)", "t_verify(6)", "t_level(4, full)"]


def test_every_calibration_prompt_serves_both_replays(monkeypatch):
    """An expensive drafter's tree replay reads fewer positions of every calibration prompt (replay_seconds; at
    least MIN_POSITIONS each), never fewer prompts; the rules' replay reads the target's greedy continuation of
    every calibration prompt, kept on the profile."""
    import sys
    from dataclasses import replace

    from tiny import hf_greedy

    tuner = sys.modules["eagle_fsd.tune.measure"]
    replayed = []
    real = tuner.replay_prompts

    def spy(model, ids, *args, **kwargs):
        rows, ranks, continuations = real(model, ids, *args, **kwargs)
        replayed.append([len(r) for r in rows])
        return rows, ranks, continuations

    monkeypatch.setattr(tuner, "replay_prompts", spy)
    model = tiny_pair()
    settings = replace(SETTINGS, prompts=3, new_tokens=tuner.MIN_POSITIONS + 12, replay_seconds=0.0)
    profile = tune.measure(model, settings, progress=False)
    prompts = tune.calibration_prompts(model.tokenizer, 3)
    assert replayed == [[tuner.MIN_POSITIONS] * 3] and len(profile.calibration) == 3
    for (sequence, prompt_length), prompt in zip(profile.calibration, prompts):
        assert prompt_length == prompt.shape[1] and sequence[:prompt_length] == prompt[0].tolist()
        new = len(sequence) - prompt_length
        assert new > 0 and sequence == hf_greedy(model.base_model, prompt, new)[0].tolist()


def test_the_replay_budget_cuts_positions_per_prompt():
    """search_space: a drafter that costs a tenth of a step or more narrows the branching; the positions per prompt
    fit replay_seconds (level forwards of every top_k and depth, plus the catch-up, per position), between
    MIN_POSITIONS and every position that has a full chain after it."""
    from dataclasses import replace

    from eagle_fsd.tune.measure import MIN_POSITIONS, search_space

    settings = replace(SETTINGS, new_tokens=64, max_depth=6, top_ks=None, replay_seconds=90.0)
    assert search_space(settings, 1.0, 40.0, 6) == ((1, 2, 4, 8), 57)  # cheap: every position
    top_ks, positions = search_space(settings, 10.0, 40.0, 6)  # 90 s / (6 prompts x 10 ms x 19 forwards) = 78.9
    assert top_ks == (1, 2, 4) and positions == 57
    assert search_space(settings, 10.0, 40.0, 12) == ((1, 2, 4), 39)  # 90 s / (12 x 10 ms x 19) = 39.5
    assert search_space(settings, 13.0, 40.0, 60) == ((1, 2), MIN_POSITIONS)
    assert search_space(replace(settings, replay_seconds=45.0), 10.0, 40.0, 12) == ((1, 2, 4), 19)