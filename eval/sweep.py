"""The FSD quality/speed frontier: accuracy and speed per FSD configuration on real benchmarks, with paired statistics.

    eagle-fsd sweep --model qwen2.5-coder-1.5b-instruct --bench humaneval gsm8k --sample 250 \\
        --fsd kl_qp:0.3,1,3 --fsd jsd:0.3 --fsd kl_qp/original:1 --plain-limit 20 --out-dir frontier

Arms: plain decoding (the speed reference; `--plain-limit N` runs it on the first N problems of each benchmark
only: greedy lossless output equals plain output, so lossless doubles as the accuracy baseline), lossless
speculative decoding, and one FSD arm per (divergence, rule, T): `--fsd DIV[/RULE]:T1,T2,...` (repeatable), or
`--thresholds` with `--fsd-divergence` / `--fsd-mode`. `--fsd kl_qp:2@16/5/2` runs an arm on another draft tree
than the model's (and `--fsd lossless@16/5/2` lossless decoding on it): FSD raises acceptance deep in a tree, so on
a shallow tree it has little to gain, and its speedup is still measured against lossless on the model's own tree.
Every arm answers problem i before any arm answers problem i + 1, so slow drift of the machine hits all arms alike. Each (arm, problem) result is appended to
OUT_DIR/records.jsonl as soon as it is scored (flushed and synced); `--resume` skips those already there, so a run can
be killed, resumed, or extended with more arms or problems without losing or repeating an answer.

Per arm and benchmark (summary.csv / summary.json): accuracy with its 95 % Wilson interval; the paired difference to
lossless on the same problems (bootstrap interval, McNemar's exact p); tau; the fuzzy share of accepted tokens;
tokens/s and the speedup over lossless and over plain decoding on the problems both ran on the same machine (paired
bootstrap interval; every record names its CPU / GPU and dtype, so an out-dir continued on another machine pairs
speeds only within one: `speed_problems` counts those pairs). problems.csv: every answer's score, tokens and time. frontier_<bench>.png: accuracy against speedup over
lossless, one line per (divergence, rule).
`--sample N`: a fixed seeded subset of N problems of every benchmark with more than N (`--seed`), else all.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from eagle_fsd.eval import gpqa, gsm8k, humaneval
from eagle_fsd.eval.frontier_plot import plot_frontier
from eagle_fsd.eval.mtbench import append_record, read_answers, warm_up
from eagle_fsd.eval.stats import (paired_answer_time, paired_difference, paired_speedup, repeated_ngram_share,
                                 wilson_interval)
from eagle_fsd.fsd import DIVERGENCES, FSD_MODES, FsdConfig
from eagle_fsd.model import load_model
from eagle_fsd.prompts import PromptFormat, generate_reply
from eagle_fsd.settings import Settings, add_fsd_args, add_model_args, add_threads_arg, parse_settings
from eagle_fsd.tree.accept import tokens_per_step
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tune import device_name

BENCHES = {"humaneval": humaneval, "gsm8k": gsm8k, "gpqa": gpqa}
PLAIN, LOSSLESS = "plain", "lossless"
CSV_FIELDS = ["bench", "method", "divergence", "mode", "threshold", "tree", "problems", "accuracy", "accuracy_low",
              "accuracy_high", "diff_vs_lossless", "diff_low", "diff_high", "only_lossless", "only_this", "p_value",
              "tokens_per_s", "speedup_vs_lossless", "speedup_low", "speedup_high", "speed_problems",
              "speedup_vs_plain", "answer_time_vs_lossless", "answer_time_low", "answer_time_high",
              "length_vs_lossless", "at_limit", "repetition", "tau", "fuzzy_fraction", "new_tokens", "wall_time"]


# ---------------------------------------------------------------- arms
@dataclass(frozen=True)
class Arm:
    """One way of decoding: plain (the target alone), lossless speculative decoding (fsd None), or FSD; on the
    model's own draft tree, or on `shape` (e.g. a deeper tree, which gives FSD more to accept)."""

    label: str
    fsd: FsdConfig | None = None
    plain: bool = False
    shape: TreeShape | None = None

    @property
    def tree(self) -> str | None:
        """The arm's own tree as N/D/K[/V] (None: the model's)."""
        return tree_label(self.shape)


def tree_label(shape: TreeShape | None) -> str | None:
    """TreeShape(16, 5, 2) -> "16/5/2" (with "/V" for a draft vocabulary of V tokens); None -> None."""
    if shape is None:
        return None
    vocab = f"/{shape.draft_vocab}" if shape.draft_vocab else ""
    return f"{shape.total_token}/{shape.depth}/{shape.branching}{vocab}"


def on_tree(label: str, shape: TreeShape | None) -> str:
    """An arm's label, with " @N/D/K" when it runs on its own tree."""
    return label if shape is None else f"{label} @{tree_label(shape)}"


GUARD_CODES = {"stop": "keep_stop", "r": "top_r", "m": "margin", "h": "min_entropy"}  # "+stop+r4+m2+h0.5"


def parse_guards(codes: list[str]) -> dict:
    """["stop", "r4", "m2", "h0.5"] -> FsdConfig's guard fields: keep_stop, top_r 4, margin 2 nats, min_entropy 0.5
    nats."""
    guards = {}
    for code in codes:
        if code == "stop":
            guards["keep_stop"] = True
            continue
        name = GUARD_CODES.get(code[:1])
        try:
            guards[name] = int(code[1:]) if name == "top_r" else float(code[1:])
        except ValueError:
            name = None
        if name is None:
            raise SystemExit(f"guard {code!r}: expected stop, rN (top r), mX (margin in nats) or hX (entropy in nats)")
    return guards


def guard_label(guards: dict) -> str:
    """The "+stop+r4" part of an arm's label, in GUARD_CODES order."""
    codes = {v: k for k, v in GUARD_CODES.items()}
    return "".join(f"+{codes[name]}" + ("" if name == "keep_stop" else f"{guards[name]:g}")
                   for name in GUARD_CODES.values() if guards.get(name) not in (None, False))


def guards_of(fsd: FsdConfig) -> dict:
    """The guard fields of an FsdConfig that are on."""
    fields = {"keep_stop": fsd.keep_stop, "top_r": fsd.top_r, "margin": fsd.margin, "min_entropy": fsd.min_entropy}
    return {name: value for name, value in fields.items() if value not in (None, False)}


def fsd_arm(divergence: str, mode: str, threshold: float, exact_prefix: int = 0, shape: TreeShape | None = None,
            guards: dict | None = None) -> Arm:
    rule = "" if mode == "reducible" else f" {mode}"
    guards = guards or {}
    return Arm(on_tree(f"{divergence}{guard_label(guards)}{rule} T={threshold:g}", shape),
               FsdConfig(threshold, divergence, mode, exact_prefix=exact_prefix, **guards), shape=shape)


def parse_tree(text: str) -> TreeShape:
    """"16/5/2" or "16/5/2/37888" -> TreeShape(total_token, depth, branching[, draft_vocab])."""
    try:
        return TreeShape(*(int(v) for v in text.split("/")))
    except (TypeError, ValueError) as err:
        raise SystemExit(f"tree {text!r}: expected TOTAL_TOKEN/DEPTH/TOP_K[/DRAFT_VOCAB] of positive ints, e.g. "
                         f"16/5/2 ({err})") from None


def parse_thresholds(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"thresholds {text!r}: expected comma-separated numbers, e.g. 0.1,0.3,1") from None
    if any(not v >= 0 for v in values):
        raise SystemExit(f"thresholds {text!r}: thresholds must be >= 0")
    return values


def parse_arm_spec(spec: str, exact_prefix: int = 0) -> list[Arm]:
    """"kl_qp:0.3,1" -> kl_qp (reducible) at T = 0.3 and 1; "kl_qp/original:1" -> the original rule at T = 1;
    guards after the divergence: "kl_qp+stop+r4:2" (eagle_fsd.fsd: stop tokens kept, top r, margin mX, entropy hX);
    a suffix "@16/5/2[/V]" runs them on that draft tree; "lossless@16/5/2" is lossless decoding on it."""
    spec_arms, _, tree = spec.partition("@")
    shape = parse_tree(tree) if tree else None
    if spec_arms == LOSSLESS and shape is not None:
        return [Arm(on_tree(LOSSLESS, shape), shape=shape)]
    head, _, values = spec_arms.partition(":")
    divergence, _, mode = head.partition("/")
    divergence, *codes = divergence.split("+")
    mode = mode or "reducible"
    if not values or divergence not in DIVERGENCES or mode not in FSD_MODES:
        raise SystemExit(f"--fsd {spec!r}: expected DIVERGENCE[/RULE]:T1,T2,...[@N/D/K] with DIVERGENCE one of "
                         f"{', '.join(DIVERGENCES)} and RULE one of {', '.join(FSD_MODES)}, e.g. kl_qp:0.3,1, or "
                         "lossless@N/D/K")
    guards = parse_guards(codes)
    return [fsd_arm(divergence, mode, t, exact_prefix, shape, guards) for t in parse_thresholds(values)]


def arms_of(settings: Settings, thresholds: str | None, specs: list[str]) -> list[Arm]:
    """Plain, lossless, then the FSD arms (--thresholds with the settings' divergence and rule, then each --fsd)."""
    fsd = settings.fsd
    arms = [Arm(PLAIN, plain=True), Arm(LOSSLESS)]
    if thresholds:
        arms += [fsd_arm(fsd.divergence, fsd.mode, t, fsd.exact_prefix) for t in parse_thresholds(thresholds)]
    for spec in specs:
        arms += parse_arm_spec(spec, fsd.exact_prefix)
    return list({arm.label: arm for arm in arms}.values())  # a configuration named twice runs once


@dataclass(frozen=True)
class SweepJob:
    """One `eagle-fsd sweep` run: the shared settings (model, tree, sampling; FSD per arm), the benchmarks and
    their problem selection, the arms, and where the results go."""

    settings: Settings
    benches: list[str]
    arms: list[Arm]
    out_dir: Path
    limit: int | None = None        # the first N problems of each benchmark
    sample: int | None = None       # a seeded subset of N problems of each benchmark larger than N
    seed: int = 0
    plain_limit: int | None = None  # plain decoding on the first N selected problems only
    resume: bool = False
    exec_timeout: float = humaneval.DEFAULT_TIMEOUT
    warmup: bool = True
    summary_only: bool = False      # write the summary and plots of the records there, run nothing


def select_problems(problems: list[dict], limit: int | None = None, sample: int | None = None,
                    seed: int = 0) -> list[dict]:
    """The first `limit` problems, or a fixed subset of `sample` drawn with `seed` (in file order), or all."""
    if sample is not None and sample < len(problems):
        keep = sorted(random.Random(seed).sample(range(len(problems)), sample))
        problems = [problems[i] for i in keep]
    return problems[:limit] if limit is not None else problems


# ---------------------------------------------------------------- one problem
def score(bench: str, problem: dict, reply: str, exec_timeout: float) -> tuple[bool, str]:
    if bench == "humaneval":
        result = humaneval.score(problem, reply, exec_timeout)
        return result.passed, result.detail or result.status
    return BENCHES[bench].judge(problem, reply)


def solve(model, fmt: PromptFormat, bench: str, problem: dict, job: SweepJob, arm: Arm) -> dict:
    """Generate, score and return one record (its reply included, so a score can be audited)."""
    torch.manual_seed(0)
    ids = fmt.encode([{"role": "user", "content": BENCHES[bench].user_message(problem)}])
    generation = replace(job.settings.generation, baseline=arm.plain)
    out = generate_reply(model, ids, generation, arm.fsd or FsdConfig(), fmt, shape=arm.shape)
    reply = fmt.decode(out.sequences[0, ids.shape[1]:])
    correct, detail = score(bench, problem, reply, job.exec_timeout)
    fsd = arm.fsd
    return {"bench": bench, "task_id": problem["task_id"], "method": arm.label,
            "threshold": fsd.threshold if fsd else None, "divergence": fsd.divergence if fsd else None,
            "mode": fsd.mode if fsd else None, "tree": arm.tree, "correct": bool(correct), "detail": detail,
            "new_tokens": out.new_tokens, "wall_time": round(out.wall_time, 4), "verify_steps": out.verify_steps,
            "accepted": sum(out.accept_lengths), "fuzzy": sum(out.fuzzy_accepts), "reply": reply,
            "trees": out.tree_steps, "tree_switches": out.tree_switches,
            "device": device_name(model.base_model.device), "dtype": str(model.base_model.dtype).removeprefix("torch."),
            "tstamp": time.time()}


# ---------------------------------------------------------------- summary
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
    """The problems both ran on one machine (records made before they named it count as one machine)."""
    return [t for t in done if t in base and done[t].get("device") == base[t].get("device")]


def speedup(done: dict[str, dict], base: dict[str, dict]) -> tuple:
    """(tokens/s ratio over `base`, interval) on the problems both ran on the same machine; Nones when none."""
    shared = same_machine(done, base)
    if not shared:
        return None, None, None
    return paired_speedup([done[t]["new_tokens"] for t in shared], [done[t]["wall_time"] for t in shared],
                          [base[t]["new_tokens"] for t in shared], [base[t]["wall_time"] for t in shared])


PROBLEM_FIELDS = ["bench", "task_id", "method", "correct", "new_tokens", "wall_time", "verify_steps", "accepted",
                  "fuzzy", "detail", "device", "dtype"]


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


# ---------------------------------------------------------------- main
def settings_of(settings: Settings) -> dict:
    """What must not change within one out-dir (arms, benches and the problem selection may: records are per
    arm and problem)."""
    m, tree, gen = settings.model, settings.tree, settings.generation
    return {"model": m.model, "drafter": m.drafter, "ea_model_path": m.ea_model_path, "dtype": m.dtype,
            "target_quant": m.target_quant,  # "auto" may round the target (eagle_fsd.target_quant): another model
            "total_token": tree.total_token, "depth": tree.depth, "top_k": tree.top_k, "draft_vocab": tree.draft_vocab,
            "max_new_token": gen.max_new_tokens, "temperature": gen.temperature, "top_p": gen.top_p,
            "conv_template": m.conv_template, "threads": m.threads, "fsd_exact_prefix": settings.fsd.exact_prefix}


def prepare_out_dir(out: Path, settings: dict, resume: bool) -> list[dict]:
    """The records already there (with --resume) after checking they were made with the same settings."""
    out.mkdir(parents=True, exist_ok=True)
    records_path, settings_path = out / "records.jsonl", out / "settings.json"
    records = read_answers(records_path, repair=resume)
    if records and not resume:
        raise SystemExit(f"{records_path} already holds {len(records)} results: pass --resume to continue it, or "
                         "choose another --out-dir")
    if settings_path.exists() and records:
        old = json.loads(settings_path.read_text())
        if old != settings:
            diff = {k: (old.get(k), settings.get(k)) for k in set(old) | set(settings) if old.get(k) != settings.get(k)}
            raise SystemExit(f"--resume: {out} was swept with other settings {diff} (then, now); use the same flags "
                             "or another --out-dir")
    settings_path.write_text(json.dumps(settings, indent=1) + "\n")
    return records


def add_selection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=int, default=None, help="the first N problems of each benchmark")
    p.add_argument("--sample", type=int, default=None,
                   help="a fixed seeded subset of N problems of each benchmark larger than N (e.g. 250: all 164 "
                        "HumanEval problems, 250 of GSM8K's 1,319)")
    p.add_argument("--seed", type=int, default=0, help="the seed of --sample")


def check_counts(p: argparse.ArgumentParser, **counts) -> None:
    for name, value in counts.items():
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} {value}: must be a positive number of problems")


def parse_args(argv) -> SweepJob:
    p = argparse.ArgumentParser(prog="eagle-fsd sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, max_new_default=512, baseline_flag=False)  # plain decoding is always one of the arms
    add_threads_arg(p)
    add_fsd_args(p, threshold_flag=False)  # per arm instead
    p.add_argument("--bench", nargs="+", choices=list(BENCHES), default=["humaneval"],
                   help="humaneval (164, pass@1), gsm8k (1,319, exact match), gpqa (198 GPQA Diamond, 4 choices)")
    p.add_argument("--thresholds", default=None,
                   help="comma-separated FSD thresholds T for --fsd-divergence and --fsd-mode")
    p.add_argument("--fsd", action="append", default=[], metavar="DIV[/RULE]:T1,T2[@N/D/K[/V]]",
                   help="FSD arms, e.g. kl_qp:0.3,1,3 or kl_qp/original:1 (repeatable); @16/5/2 runs them on that "
                        "draft tree instead of the model's, and lossless@16/5/2 is lossless decoding on it")
    add_selection_args(p)
    p.add_argument("--plain-limit", type=int, default=None,
                   help="plain decoding (the speed reference) on the first N selected problems only")
    p.add_argument("--out-dir", type=Path, default=Path("sweep_out"))
    p.add_argument("--resume", action="store_true", help="skip (arm, problem) pairs already in the out-dir")
    p.add_argument("--exec-timeout", type=float, default=humaneval.DEFAULT_TIMEOUT,
                   help="seconds a HumanEval program may run")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--summary-only", action="store_true",
                   help="summarize the out-dir's records (e.g. of a stopped run) without running anything")
    args = p.parse_args(argv)
    settings = parse_settings(p, args)
    check_counts(p, limit=args.limit, sample=args.sample, plain_limit=args.plain_limit)
    arms = arms_of(settings, args.thresholds, args.fsd)
    return SweepJob(settings, args.bench, arms, args.out_dir, args.limit, args.sample, args.seed, args.plain_limit,
                    args.resume or args.summary_only, args.exec_timeout, args.warmup, args.summary_only)


def pending(problems: dict[str, list[dict]], arms: list[Arm], done: set, plain_limit: int | None) -> list[tuple]:
    """(bench, problem, arm) still to run, problem by problem (every arm of problem i before problem i + 1)."""
    return [(bench, p, arm) for bench, ps in problems.items() for i, p in enumerate(ps) for arm in arms
            if (bench, arm.label, p["task_id"]) not in done
            and not (arm.plain and plain_limit is not None and i >= plain_limit)]


def run_todo(job: SweepJob, todo: list, records: list[dict], model=None) -> None:
    """Generate and score every (bench, problem, arm) left, appending each record as soon as it is scored."""
    from tqdm import tqdm

    model = model if model is not None else load_model(job.settings)
    fmt = PromptFormat(model.tokenizer, job.settings.model.conv_template)
    if job.warmup:
        warm_up(model, job.settings.generation, job.settings.fsd, fmt)
    bar = tqdm(todo, unit="run", dynamic_ncols=True)  # its ETA: the mean time per run so far × runs left
    try:
        for bench, problem, arm in bar:
            bar.set_description(f"{bench} {arm.label}")
            record = solve(model, fmt, bench, problem, job, arm)
            append_record(job.out_dir / "records.jsonl", record)
            records.append(record)
    except KeyboardInterrupt:  # the results so far still make a summary and a plot
        print(f"\ninterrupted: the finished runs are in {job.out_dir / 'records.jsonl'}; add --resume to continue")
    finally:
        bar.close()


def load_selection(job: SweepJob) -> dict[str, list[dict]]:
    return {bench: select_problems(BENCHES[bench].load_problems(), job.limit, job.sample, job.seed)
            for bench in job.benches}


def run_sweep(job: SweepJob, model=None) -> list[dict]:
    """Run what is left of `job` and write its summary and plots; the summary rows."""
    problems = load_selection(job)
    records = prepare_out_dir(job.out_dir, settings_of(job.settings), job.resume)
    done = {(r["bench"], r["method"], r["task_id"]) for r in records}
    todo = pending(problems, job.arms, done, job.plain_limit)
    if done:
        print(f"resuming {job.out_dir}: {len(done)} results there, {len(todo)} to go")
    if todo and not job.summary_only:
        run_todo(job, todo, records, model)
    selection = {bench: [p["task_id"] for p in ps] for bench, ps in problems.items()}
    rows = summarize(records, selection, job.arms, job.settings.generation.max_new_tokens)
    write_summary(job.out_dir, rows, settings_of(job.settings), records)
    gen = job.settings.generation
    for bench in problems:
        mine = [r for r in rows if r["bench"] == bench]
        if mine:
            plot_frontier(job.out_dir / f"frontier_{bench}.png", mine,
                          f"{job.settings.model.model}, {bench}, temperature {gen.temperature:g}")
    return rows


def main(argv=None) -> int:
    job = parse_args(argv)
    rows = run_sweep(job)
    print_rows(rows)
    print(f"wrote {job.out_dir}/summary.csv, summary.json and frontier_<bench>.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
