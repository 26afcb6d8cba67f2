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
import json
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from eagle_fsd.eval import gpqa, gsm8k, humaneval
# the arms and the summary live in their own modules; their names stay importable from here (sweep.Arm, ...)
from eagle_fsd.eval.arms import (GUARD_CODES, LOSSLESS, PLAIN, Arm, arms_of, fsd_arm, guard_label, guards_of,
                                 on_tree, parse_arm_spec, parse_guards, parse_thresholds, parse_tree, tree_label)
from eagle_fsd.eval.frontier_plot import plot_frontier
from eagle_fsd.eval.mtbench import append_record, read_answers, warm_up, warm_up_arms
from eagle_fsd.eval.sweep_summary import (CSV_FIELDS, PROBLEM_FIELDS, arm_statistics, by_method, per_answer,
                                          print_rows, same_machine, speedup, summarize, write_summary)
from eagle_fsd.fsd import FsdConfig
from eagle_fsd.model import load_model
from eagle_fsd.prompts import PromptFormat, generate_reply
from eagle_fsd.settings import Settings, add_fsd_args, add_model_args, add_threads_arg, parse_settings
from eagle_fsd.tune import cpu_class, device_name

BENCHES = {"humaneval": humaneval, "gsm8k": gsm8k, "gpqa": gpqa}


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
            "cpu": cpu_class() if model.base_model.device.type == "cpu" else "", "tstamp": time.time()}


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
        warm_up_arms(model, job.settings.generation, job.arms, fmt)
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
