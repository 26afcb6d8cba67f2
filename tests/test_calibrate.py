"""Threshold calibration: the fixed-sequence choice on synthetic data where the right T is known, the whole
calibrate flow (calibration split, held-out check, record) on a tiny model, and the label-free NLL mode."""
import json
import math

import pytest
import torch

from eagle_fsd.eval import calibrate, sweep

torch.set_num_threads(1)
T_TRUE = 0.3  # in the synthetic benchmark, thresholds above this break every 4th problem


def scores(n, broken_by: dict):
    """{method: {key: correct}}: lossless solves every problem; an arm breaks the problems in broken_by[label]."""
    table = {sweep.LOSSLESS: {("b", i): True for i in range(n)}}
    for label, broken in broken_by.items():
        table[label] = {("b", i): i not in broken for i in range(n)}
    return table


def arms(*thresholds, divergence="kl_qp"):
    return [sweep.Arm(sweep.LOSSLESS)] + [sweep.fsd_arm(divergence, "reducible", t) for t in thresholds]


def test_fixed_sequence_picks_the_last_threshold_within_budget():
    every_fourth = set(range(0, 200, 4))
    table = scores(200, {"kl_qp T=0.1": set(), "kl_qp T=0.3": set(), "kl_qp T=1": every_fourth,
                         "kl_qp T=3": every_fourth | {1}})
    keys = [("b", i) for i in range(200)]
    (chosen, trials), = calibrate.choose_by_accuracy(table, arms(0.1, 0.3, 1, 3), keys, budget=1.0).values()
    assert chosen == T_TRUE
    assert [(t.threshold, t.passed) for t in trials] == [(0.1, True), (0.3, True), (1, False)]  # stops at 1
    assert trials[2].loss == pytest.approx(25.0) and trials[2].upper > 25.0


def test_fixed_sequence_stops_at_the_first_failure_and_counts_the_interval():
    # one broken problem of 200 is a 0.5-point drop, but its upper bound (1.5 points) exceeds a 1-point budget;
    # T = 3 breaking nothing cannot be reached past the failure at T = 1
    table = scores(200, {"kl_qp T=0.3": set(), "kl_qp T=1": {7}, "kl_qp T=3": set()})
    keys = [("b", i) for i in range(200)]
    (chosen, trials), = calibrate.choose_by_accuracy(table, arms(0.3, 1, 3), keys, budget=1.0).values()
    assert chosen == 0.3 and len(trials) == 2 and trials[1].loss == pytest.approx(0.5)
    (chosen, _), = calibrate.choose_by_accuracy(table, arms(0.3, 1, 3), keys, budget=2.0).values()
    assert chosen == 3
    assert calibrate.fixed_sequence([(1.0, 5.0, 9.0)], 1.0)[0] is None  # nothing passes: lossless


def test_split_is_disjoint_seeded_and_complete():
    problems = {"b": [{"task_id": i} for i in range(11)]}
    cal, held = calibrate.split(problems, seed=0)
    ids = [p["task_id"] for p in cal["b"]] + [p["task_id"] for p in held["b"]]
    assert sorted(ids) == list(range(11)) and len(cal["b"]) == 6 and not set(ids[:6]) & set(ids[6:])
    assert calibrate.split(problems, seed=0) == (cal, held) and calibrate.split(problems, seed=1) != (cal, held)


def test_calibrate_flow_finds_the_known_threshold(tmp_path, tiny_chat_model, monkeypatch):
    """Through the runner: calibration split, the choice, the held-out run of lossless and the chosen T only."""
    calls = []

    def synthetic_solve(model, fmt, bench, problem, job, arm):
        calls.append((problem["task_id"], arm.label))
        index = int(problem["task_id"].split("/")[1])
        broken = arm.fsd is not None and arm.fsd.threshold > T_TRUE and index % 4 == 0
        return {"bench": bench, "task_id": problem["task_id"], "method": arm.label, "correct": not broken,
                "new_tokens": 4, "wall_time": 0.1, "verify_steps": 2, "accepted": 2, "fuzzy": 0}

    monkeypatch.setattr(sweep, "solve", synthetic_solve)
    monkeypatch.setenv("EAGLE_FSD_CACHE", str(tmp_path / "cache"))
    job = calibrate.parse_args(["--model", "tiny", "--bench", "gsm8k", "--limit", "40", "--budget", "1",
                                "--fsd", "kl_qp:0.1,0.3,1,3", "--out-dir", str(tmp_path / "cal")])
    result = calibrate.calibrate(job, tiny_chat_model)
    (choice,) = result["choices"]
    assert choice["threshold"] == T_TRUE and choice["held_out_drop"] == 0 and choice["missed_by"] == 0
    # calibration: 20 problems x (lossless + 4 candidates); held-out: the other 20 x (lossless, the chosen T)
    assert len(calls) == 20 * 5 + 20 * 2
    calibration, held_out = {t for t, _ in calls[:100]}, {t for t, _ in calls[100:]}
    assert len(calibration) == len(held_out) == 20 and not calibration & held_out
    assert {label for _, label in calls[100:]} == {"lossless", "kl_qp T=0.3"}
    recorded = json.loads((tmp_path / "cache" / "calibrations.jsonl").read_text().splitlines()[-1])
    assert recorded["model"] == "tiny" and recorded["choices"][0]["threshold"] == T_TRUE
    assert json.loads((tmp_path / "cal" / "calibration.json").read_text()) == recorded


def test_extra_nll_hand_values():
    lossless = {0: (10.0, 10), 1: (30.0, 10)}  # 2 nats per token over both
    arm = {0: (12.0, 10), 1: (33.0, 10)}       # 2.25
    extra, low, high = calibrate.extra_nll(lossless, arm)
    # resampling 2 prompts: both prompt 0 (extra 0.2), both prompt 1 (0.3) or one of each (0.25)
    assert (extra, low, high) == pytest.approx((0.25, 0.2, 0.3))
    assert calibrate.extra_nll(lossless, lossless) == (0.0, 0.0, 0.0)


def test_reply_nll_is_the_targets_own_loss(tiny_chat_model):
    target = tiny_chat_model.base_model
    prompt, reply = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10, 11]])
    with torch.no_grad():
        logits = target(torch.cat([prompt, reply], 1)).logits[0].float()
    expected = torch.nn.functional.cross_entropy(logits[3:6], reply[0], reduction="sum")
    assert calibrate.reply_nll(tiny_chat_model, prompt, reply) == pytest.approx(float(expected), rel=1e-5)


def test_label_free_calibration(tmp_path, tiny_chat_model, monkeypatch):
    monkeypatch.setenv("EAGLE_FSD_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\nCount to three.\n")
    job = calibrate.parse_args(["--model", "tiny", "--prompts", str(prompts), "--nll-bound", "0",
                                "--fsd", "kl_qp:0,inf", "--max-new-token", "12", "--out-dir", str(tmp_path / "c")])
    result = calibrate.calibrate(job, tiny_chat_model)
    (choice,) = result["choices"]
    first = choice["trials"][0]  # reducible T = 0 is exactly lossless: no extra NLL at all
    assert (first["threshold"], first["loss"], first["upper"], first["passed"]) == (0, 0.0, 0.0, True)
    assert choice["threshold"] in (0, math.inf)
    lines = (tmp_path / "c" / "nll.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 3  # prompts x (lossless, T=0, T=inf)


def test_calibrate_argument_errors(tmp_path):
    with pytest.raises(SystemExit):
        calibrate.parse_args(["--budget", "-1"])
    with pytest.raises(SystemExit):
        calibrate.parse_args(["--prompts", str(tmp_path / "missing.txt")])


def test_the_recommendation_is_the_passing_threshold_fastest_per_answer():
    """T = 1 passes but its replies grow: per answer it is slower than T = 0.3, which is recommended; T = 3 failed
    and is never recommended, however fast; untimed, the largest passing T."""
    candidates = arms(0.3, 1, 3)
    keys = [("b", i) for i in range(4)]
    times = {sweep.LOSSLESS: {k: 2.0 for k in keys}, "kl_qp T=0.3": {k: 1.6 for k in keys},
             "kl_qp T=1": {k: 2.5 for k in keys}, "kl_qp T=3": {k: 0.5 for k in keys}}
    (family, members), = calibrate.families(candidates).items()
    ratios = calibrate.answer_time_ratios(times, members, keys)
    assert ratios == pytest.approx({0.3: 1.25, 1: 0.8, 3: 4.0})
    trials = [calibrate.Trial(0.3, 0.0, 0.5, True), calibrate.Trial(1, 0.2, 0.9, True),
              calibrate.Trial(3, 5.0, 9.0, False)]
    assert calibrate.recommended(trials, ratios) == 0.3
    assert calibrate.recommended(trials, {}) == 1
    assert calibrate.recommended(trials[2:], ratios) is None


def test_guarded_arms_form_their_own_family():
    candidates = arms(0.3, 1) + sweep.parse_arm_spec("kl_qp+stop+r4:0.3,1")
    groups = calibrate.families(candidates)
    assert sorted(groups) == [("kl_qp", "reducible"), ("kl_qp+stop+r4", "reducible")]
    guarded = groups[("kl_qp+stop+r4", "reducible")]
    assert [a.label for a in guarded] == ["kl_qp+stop+r4 T=0.3", "kl_qp+stop+r4 T=1"]
    assert guarded[0].fsd.keep_stop and guarded[0].fsd.top_r == 4
