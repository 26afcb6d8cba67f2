"""A sweep's summary: per (benchmark, arm) accuracy with its interval, the paired difference to lossless, tau, the
fuzzy share, speed and speedups on the same machine, and per answer time, length, limit and repetition; written as
summary.csv / summary.json / problems.csv and printed as a table."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from eagle_fsd.eval.arms import LOSSLESS, PLAIN, Arm
from eagle_fsd.eval.stats import (paired_answer_time, paired_difference, paired_speedup, repeated_ngram_share,
                                 wilson_interval)
from eagle_fsd.tree.accept import tokens_per_step

CSV_FIELDS = ["bench", "method", "divergence", "mode", "threshold", "tree", "problems", "accuracy", "accuracy_low",
              "accuracy_high", "diff_vs_lossless", "diff_low", "diff_high", "only_lossless", "only_this", "p_value",
              "tokens_per_s", "speedup_vs_lossless", "speedup_low", "speedup_high", "speed_problems",
              "speedup_vs_plain", "answer_time_vs_lossless", "answer_time_low", "answer_time_high",
              "length_vs_lossless", "at_limit", "repetition", "tau", "fuzzy_fraction", "new_tokens", "wall_time"]



def by_method(records: list[dict], bench: str, task_ids: list[str]) -> dict[str, dict[str, dict]]:
    """{method: {task_id: record}} of one benchmark's selected problems."""
    wanted, table = set(task_ids), {}
    for r in records:
        if r["bench"] == bench and r["task_id"] in wanted:
            table.setdefault(r["method"], {})[r["task_id"]] = r
    return table


def summarize(records: list[dict], selection: dict[str, list[str]], arms: list[Arm], limit: int | None = None) -> list[dict]:
    """One row per (bench, arm) over the selected problems that arm has finished; limit: the replies' token limit
    (for the share of replies that reached it)."""
    rows = []
    for bench, task_ids in selection.items():
        table = by_method(records, bench, task_ids)
        for arm in arms:
            if table.get(arm.label):
                fsd = arm.fsd
                rows.append({"bench": bench, "method": arm.label, "divergence": fsd.divergence if fsd else None,
                             "mode": fsd.mode if fsd else None, "threshold": fsd.threshold if fsd else None,
                             "tree": arm.tree,
                             **arm_statistics(table[arm.label], table.get(LOSSLESS, {}), table.get(PLAIN, {}), limit)})
    return rows


def arm_statistics(done: dict[str, dict], lossless: dict[str, dict], plain: dict[str, dict],
                   limit: int | None = None) -> dict:
    """Accuracy (Wilson interval), the paired difference to lossless, tau, fuzzy share, speed and speedups, and per
    answer: time per answer and reply length against lossless, the share of replies at the token limit, and how much
    a reply repeats itself (per_answer)."""
    rs = list(done.values())
    correct, tokens, seconds = (sum(r[k] for r in rs) for k in ("correct", "new_tokens", "wall_time"))
    steps, accepted = sum(r["verify_steps"] for r in rs), sum(r["accepted"] for r in rs)
    low, high = wilson_interval(correct, len(rs))
    row = {"problems": len(rs), "accuracy": correct / len(rs), "accuracy_low": low, "accuracy_high": high,
           "tokens_per_s": tokens / seconds if seconds else None,
           "tau": tokens_per_step(accepted, steps) if steps else None,
           "fuzzy_fraction": sum(r["fuzzy"] for r in rs) / accepted if accepted else 0.0,
           "new_tokens": tokens, "wall_time": round(seconds, 3)}
    shared = [t for t in done if t in lossless]
    diff = paired_difference([lossless[t]["correct"] for t in shared], [done[t]["correct"] for t in shared])
    row.update(diff_vs_lossless=diff.difference, diff_low=diff.low, diff_high=diff.high,
               only_lossless=diff.only_first, only_this=diff.only_second, p_value=diff.p_value)
    ratio, low, high = speedup(done, lossless)
    row.update(speedup_vs_lossless=ratio, speedup_low=low, speedup_high=high,
               speed_problems=len(same_machine(done, lossless)), speedup_vs_plain=speedup(done, plain)[0])
    row.update(per_answer(done, lossless, limit))
    return row


def per_answer(done: dict[str, dict], lossless: dict[str, dict], limit: int | None) -> dict:
    """Time per finished answer × lossless (lossless seconds / these, paired, same machine, with its interval), reply
    length × lossless (tokens over lossless tokens on the shared problems), the share of replies that reached `limit`
    tokens, and the mean share of repeated word 4-grams in the replies."""
    timed = same_machine(done, lossless)
    time_ratio = paired_answer_time([done[t]["wall_time"] for t in timed], [lossless[t]["wall_time"] for t in timed]) \
        if timed else (None, None, None)
    shared = [t for t in done if t in lossless]
    base_tokens = sum(lossless[t]["new_tokens"] for t in shared)
    rs = list(done.values())
    return {"answer_time_vs_lossless": time_ratio[0], "answer_time_low": time_ratio[1],
            "answer_time_high": time_ratio[2],
            "length_vs_lossless": sum(done[t]["new_tokens"] for t in shared) / base_tokens if base_tokens else None,
            "at_limit": sum(r["new_tokens"] >= limit for r in rs) / len(rs) if limit else None,
            "repetition": sum(repeated_ngram_share(r.get("reply", "").split()) for r in rs) / len(rs)}


def same_machine(done: dict[str, dict], base: dict[str, dict]) -> list[str]:
    """The problems both ran on one machine: the same CPU name and class (records made before they named one count
    as one machine)."""
    def machine(record):
        return record.get("device"), record.get("cpu")
    return [t for t in done if t in base and machine(done[t]) == machine(base[t])]


def speedup(done: dict[str, dict], base: dict[str, dict]) -> tuple:
    """(tokens/s ratio over `base`, interval) on the problems both ran on the same machine; Nones when none."""
    shared = same_machine(done, base)
    if not shared:
        return None, None, None
    return paired_speedup([done[t]["new_tokens"] for t in shared], [done[t]["wall_time"] for t in shared],
                          [base[t]["new_tokens"] for t in shared], [base[t]["wall_time"] for t in shared])


PROBLEM_FIELDS = ["bench", "task_id", "method", "correct", "new_tokens", "wall_time", "verify_steps", "accepted",
                  "fuzzy", "detail", "device", "cpu", "dtype"]


def write_summary(out_dir: Path, rows: list[dict], settings: dict, records: list[dict]) -> None:
    """summary.csv / summary.json: one row per (bench, arm); problems.csv: one row per answer (records.jsonl without
    the replies)."""
    with open(out_dir / "problems.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=PROBLEM_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    with open(out_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row[k] is None else round(row[k], 4) if isinstance(row[k], float) else row[k])
                             for k in CSV_FIELDS})
    (out_dir / "summary.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")


def print_rows(rows: list[dict]) -> None:
    print(f"{'bench':<10}{'method':<22}{'n':>5}{'accuracy':>9}{'  Δ vs lossless [95% CI]':<26}{'p':>6}"
          f"{'tok/s':>7}{'×lossless':>10}{'×plain':>7}{'answer×':>8}{'length×':>8}{'limit':>6}{'tau':>6}{'fuzzy':>6}")
    for r in rows:
        def f(key, spec=".2f"):
            return "-" if r[key] is None else format(r[key], spec)
        diff = f"{100 * r['diff_vs_lossless']:+.1f} [{100 * r['diff_low']:+.1f}, {100 * r['diff_high']:+.1f}]" \
            if r["diff_vs_lossless"] is not None and not math.isnan(r["diff_vs_lossless"]) else "-"
        print(f"{r['bench']:<10}{r['method']:<22}{r['problems']:>5}{f('accuracy', '.3f'):>9}  {diff:<24}"
              f"{f('p_value'):>6}{f('tokens_per_s'):>7}{f('speedup_vs_lossless'):>9}x{f('speedup_vs_plain'):>6}x"
              f"{f('answer_time_vs_lossless'):>7}x{f('length_vs_lossless'):>7}x{f('at_limit'):>6}"
              f"{f('tau'):>6}{f('fuzzy_fraction'):>6}")
