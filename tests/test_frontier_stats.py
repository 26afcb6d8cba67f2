"""The frontier runner's statistics against values computed by hand."""
import math

import pytest

from eagle_fsd.eval import stats, sweep


def test_wilson_interval_hand_values():
    # 8/10, z = 1.959964: centre 0.8 + z²/20 = 0.99207, half z·sqrt(0.016 + z²/400) = 0.31362, scale 1 + z²/10
    assert stats.wilson_interval(8, 10) == pytest.approx((0.49016, 0.94332), abs=1e-5)
    assert stats.wilson_interval(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)  # z²/10 / (1 + z²/10)
    assert stats.normal_quantile(0.975) == pytest.approx(1.959964, abs=1e-6)


def test_mcnemar_exact_hand_values():
    assert stats.mcnemar_exact(1, 6) == pytest.approx(2 * (1 + 7) / 2 ** 7)  # 0.125
    assert stats.mcnemar_exact(0, 5) == pytest.approx(2 / 2 ** 5)
    assert stats.mcnemar_exact(3, 3) == 1.0 and stats.mcnemar_exact(0, 0) == 1.0


def test_paired_difference_hand_values():
    # resampling 2 problems with differences (1, 0): means 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4, so the
    # 2.5 % and 97.5 % percentiles are 0 and 1
    d = stats.paired_difference([False, True], [True, True])
    assert (d.difference, d.low, d.high, d.only_first, d.only_second) == (0.5, 0.0, 1.0, 0, 1)
    same = stats.paired_difference([True, False, True], [True, False, True])
    assert (same.difference, same.low, same.high, same.p_value) == (0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="same problems"):
        stats.paired_difference([True], [True, False])


def test_paired_speedup_of_a_constant_ratio_is_exact():
    ratio, low, high = stats.paired_speedup([10, 20, 30], [1, 2, 3], [10, 20, 30], [2, 4, 6])
    assert (ratio, low, high) == pytest.approx((2.0, 2.0, 2.0))


def record(task, method, correct, tokens=10, seconds=1.0, steps=5, accepted=5, fuzzy=0):
    return {"bench": "b", "task_id": task, "method": method, "correct": correct, "new_tokens": tokens,
            "wall_time": seconds, "verify_steps": steps, "accepted": accepted, "fuzzy": fuzzy}


def test_summary_rows_hand_values():
    records = []
    for task, lossless, fuzzy in zip("abcd", (1, 1, 0, 1), (1, 0, 0, 1)):
        records.append(record(task, "plain", lossless, seconds=4.0, steps=10, accepted=0))
        records.append(record(task, "lossless", lossless, seconds=2.0))
        records.append(record(task, "kl_qp T=1", fuzzy, seconds=1.0, steps=4, accepted=6, fuzzy=2))
    arms = [sweep.Arm("plain", plain=True), sweep.Arm("lossless"), sweep.fsd_arm("kl_qp", "reducible", 1.0)]
    plain, lossless, fsd = sweep.summarize(records, {"b": list("abcd")}, arms)
    assert (fsd["accuracy"], fsd["diff_vs_lossless"], fsd["only_lossless"], fsd["only_this"]) == (0.5, -0.25, 1, 0)
    assert fsd["p_value"] == 1.0  # one discordant problem: 2 · P(X <= 0 | n = 1) = 1
    assert fsd["accuracy_low"] == pytest.approx(stats.wilson_interval(2, 4)[0])
    assert fsd["tau"] == (24 + 16) / 16 and fsd["fuzzy_fraction"] == 8 / 24
    assert (fsd["speedup_vs_lossless"], fsd["speedup_vs_plain"]) == pytest.approx((2.0, 4.0))
    assert (fsd["tokens_per_s"], lossless["tokens_per_s"], plain["tokens_per_s"]) == (10.0, 5.0, 2.5)
    assert lossless["diff_vs_lossless"] == 0.0 and math.isclose(lossless["speedup_vs_plain"], 2.0)
    # plain decoding ran on a subset only: speedups over it use the problems it ran
    subset = [r for r in records if not (r["method"] == "plain" and r["task_id"] != "a")]
    rows = sweep.summarize(subset, {"b": list("abcd")}, arms)
    assert rows[0]["problems"] == 1 and rows[2]["speedup_vs_plain"] == pytest.approx(4.0)
    # lossless has not reached problem d yet: the paired difference is over a, b, c only
    partial = [r for r in records if not (r["method"] == "lossless" and r["task_id"] == "d")]
    fsd = sweep.summarize(partial, {"b": list("abcd")}, arms)[2]
    assert fsd["problems"] == 4 and fsd["diff_vs_lossless"] == pytest.approx(-1 / 3)


def test_speed_pairs_only_answers_made_on_one_machine():
    """An out-dir continued on another machine: accuracy pairs every problem, speed only those whose two answers
    ran on one machine (records without a device, made before records named it, count as one machine)."""
    records = []
    for task, device in zip("abcd", (None, None, "cpu-x", "cpu-x")):
        for method, seconds in (("lossless", 2.0), ("kl_qp T=1", 1.0)):
            r = record(task, method, task != "d", seconds=seconds if device is None else seconds * 3)
            if device is not None:
                r["device"] = device
            records.append(r)
    records[-1]["wall_time"] = 1.5  # d's FSD answer: 2x lossless
    records[-1]["correct"] = True
    records[-2]["device"] = "cpu-y"  # d's lossless answer came from another machine
    arms = [sweep.Arm("lossless"), sweep.fsd_arm("kl_qp", "reducible", 1.0)]
    lossless, fsd = sweep.summarize(records, {"b": list("abcd")}, arms)
    assert fsd["speed_problems"] == 3 and lossless["speed_problems"] == 4
    assert fsd["speedup_vs_lossless"] == pytest.approx(2.0)  # a, b at 2x and c at 2x; d left out
    assert fsd["diff_vs_lossless"] == pytest.approx(0.25)  # accuracy pairs all four: d right only with FSD
    records[-2]["device"] = "cpu-x"  # d's lossless answer: the same CPU name, but another CPU class
    records[-2]["cpu"] = "family 25 model 1, avx2"
    records[-1]["cpu"] = "family 25 model 17, avx512_vnni"
    assert sweep.summarize(records, {"b": list("abcd")}, arms)[1]["speed_problems"] == 3


def test_per_answer_figures_hand_values():
    """FSD emits tokens about twice as fast (2.06x) but its replies are 2.75x as long: per answer it is slower
    (0.75x), and the figures say so. Problem c hit the 20-token limit with FSD, none did lossless."""
    records = []
    for task, fsd_tokens in zip("abcd", (10, 10, 20, 0)):
        records.append(record(task, "lossless", True, tokens=5, seconds=1.0))
        records.append(record(task, "kl_qp T=1", True, tokens=fsd_tokens or 15, seconds=4 / 3))
    records[1]["reply"] = "a b c d a b c d"  # 8 words: 5 four-grams, "a b c d" seen twice -> 1/5 repeated
    arms = [sweep.Arm("lossless"), sweep.fsd_arm("kl_qp", "reducible", 1.0)]
    lossless, fsd = sweep.summarize(records, {"b": list("abcd")}, arms, limit=20)
    assert fsd["speedup_vs_lossless"] == pytest.approx(55 / (16 / 3) / 5)  # 55 tokens in 16/3 s vs 20 in 4 s
    assert fsd["answer_time_vs_lossless"] == pytest.approx(4 / (16 / 3))  # 0.75: slower per answer
    assert fsd["answer_time_low"] == pytest.approx(0.75) and fsd["answer_time_high"] == pytest.approx(0.75)
    assert fsd["length_vs_lossless"] == pytest.approx(55 / 20)
    assert (fsd["at_limit"], lossless["at_limit"]) == (0.25, 0.0)
    assert fsd["repetition"] == pytest.approx(0.2 / 4) and lossless["repetition"] == 0.0
    assert lossless["answer_time_vs_lossless"] == pytest.approx(1.0)


def test_answer_time_interval_and_repetition_measure():
    ratio, low, high = stats.paired_answer_time([1.0, 3.0], [2.0, 2.0])  # resamples: (1,1) 2.0, (1,3) 1.0, (3,3) 0.67
    assert ratio == 1.0 and low == pytest.approx(2 / 3) and high == pytest.approx(2.0)
    assert stats.repeated_ngram_share("the cat sat on the mat".split(), n=2) == 0.0
    assert stats.repeated_ngram_share("go go go go".split(), n=2) == pytest.approx(2 / 3)
    assert stats.repeated_ngram_share(["short"], n=4) == 0.0


def test_frontier_points_one_curve_per_rule_and_guards_on_time_per_answer(tmp_path):
    """The picture's curves: one per rule with its guards (and pinned tree), thresholds in order, x the time per
    answer (not tokens/s: replies that grow count), y the accuracy."""
    from eagle_fsd.eval.frontier_plot import frontier_points, plot_frontier

    def row(method, threshold, answer, speed, accuracy, tree=None):
        return {"method": method, "threshold": threshold, "tree": tree, "answer_time_vs_lossless": answer,
                "answer_time_low": answer - 0.02, "answer_time_high": answer + 0.02, "speedup_vs_lossless": speed,
                "speedup_low": speed - 0.01, "speedup_high": speed + 0.01, "accuracy": accuracy,
                "diff_low": -0.05, "diff_high": 0.05, "problems": 20}

    rows = [row("lossless", None, 1.0, 1.0, 0.5), row("plain", None, 0.7, 0.7, 0.5),
            row("kl_qp T=2", 2.0, 0.95, 1.10, 0.45), row("kl_qp T=0.5", 0.5, 1.01, 1.02, 0.5),
            row("kl_qp+stop T=2", 2.0, 1.08, 1.09, 0.48), row("kl_qp T=2 @16/5/2", 2.0, 1.2, 1.3, 0.4, "16/5/2")]
    curves = frontier_points(rows)
    assert list(curves) == ["kl_qp", "kl_qp+stop", "kl_qp, tree 16/5/2"]
    assert [p["T"] for p in curves["kl_qp"]] == [0.5, 2.0]
    assert [p["x"] for p in curves["kl_qp"]] == [1.01, 0.95] and curves["kl_qp"][1]["x_low"] == pytest.approx(0.93)
    assert [p["y"] for p in curves["kl_qp+stop"]] == [0.48]
    assert plot_frontier(tmp_path / "f.png", rows, "t").stat().st_size > 0
