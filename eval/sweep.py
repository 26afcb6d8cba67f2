"""Quality against speed over FSD thresholds: HumanEval pass@1 and GSM8K exact match, per threshold T.

    eagle-fsd sweep --model qwen2.5-coder-1.5b-instruct --bench humaneval gsm8k --thresholds 0.1,0.3,1,3 --limit 20

Every problem runs through plain decoding (the speed reference), lossless speculative decoding and FSD at each T,
one method after the other (so slow drift of the machine hits all methods alike). Each (method, problem) result is
appended to OUT_DIR/records.jsonl as soon as it is scored; `--resume` skips those already there, so a sweep can be
stopped, resumed, or extended with more thresholds or problems. Written at the end (and on every run):
summary.csv, summary.json and sweep.png (accuracy against speedup, one point per T, lossless and plain marked).
speedup = tokens/s over plain decoding's tokens/s on the same problems; tau = tokens per target forward.
"""
from __future__ import annotations

import argparse
import csv
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from eagle_fsd.tree.accept import tokens_per_step
from eagle_fsd.eval import gsm8k, humaneval
from eagle_fsd.eval.mtbench import append_record, read_answers, warm_up
from eagle_fsd.fsd import FsdConfig
from eagle_fsd.model import load_model
from eagle_fsd.prompts import PromptFormat, generate_reply
from eagle_fsd.settings import GenerationSettings, Settings, add_fsd_args, add_model_args, parse_settings

BENCHES = {"humaneval": humaneval, "gsm8k": gsm8k}
PLAIN, LOSSLESS = "plain", "lossless"
CSV_FIELDS = ["bench", "method", "threshold", "problems", "accuracy", "tokens_per_s", "speedup", "tau",
              "fuzzy_fraction", "new_tokens", "wall_time"]


# ---------------------------------------------------------------- methods
def parse_thresholds(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--thresholds {text!r}: expected comma-separated numbers, e.g. 0.1,0.3,1") from None
    if any(v < 0 for v in values):
        raise SystemExit(f"--thresholds {text!r}: thresholds must be >= 0")
    return values


def methods(thresholds: list[float]) -> list[tuple[str, float | None]]:
    """(label, FSD threshold): plain decoding first (the speed reference), lossless, then each T."""
    return [(PLAIN, None), (LOSSLESS, None)] + [(f"T={t:g}", t) for t in thresholds]


def method_settings(settings: Settings, label: str, threshold: float | None) -> tuple[GenerationSettings, FsdConfig]:
    """The sweep's settings for one method: plain decoding for PLAIN, else speculative with FSD threshold T."""
    return (replace(settings.generation, baseline=label == PLAIN), replace(settings.fsd, threshold=threshold))


@dataclass(frozen=True)
class SweepJob:
    """One `eagle-fsd sweep` run: the shared settings (their FSD threshold unused: each method sets its own), the
    benchmarks, the thresholds and where the results go."""

    settings: Settings
    benches: list[str]
    thresholds: list[float]
    out_dir: Path
    limit: int | None = None  # the first N problems of each benchmark
    resume: bool = False
    exec_timeout: float = humaneval.DEFAULT_TIMEOUT
    warmup: bool = True


# ---------------------------------------------------------------- one problem
def solve(model, fmt: PromptFormat, bench: str, problem: dict, job: SweepJob, label: str, threshold) -> dict:
    """Generate, score and return one record (its reply included, so a score can be audited)."""
    module = BENCHES[bench]
    torch.manual_seed(0)
    ids = fmt.encode([{"role": "user", "content": module.user_message(problem)}])
    out = generate_reply(model, ids, *method_settings(job.settings, label, threshold), fmt)
    reply = fmt.decode(out.sequences[0, ids.shape[1]:])
    if bench == "humaneval":
        result = humaneval.score(problem, reply, job.exec_timeout)
        correct, detail = result.passed, result.detail or result.status
    else:
        answer = gsm8k.extract_answer(reply)
        correct, detail = answer == problem["target"], f"answer {answer}, target {problem['target']}"
    return {"bench": bench, "task_id": problem["task_id"], "method": label, "threshold": threshold,
            "correct": bool(correct), "detail": detail, "new_tokens": out.new_tokens,
            "wall_time": round(out.wall_time, 4), "verify_steps": out.verify_steps,
            "accepted": sum(out.accept_lengths), "fuzzy": sum(out.fuzzy_accepts), "reply": reply,
            "tstamp": time.time()}


# ---------------------------------------------------------------- summary
def summarize(records: list[dict], selection: dict[str, list[str]], labels: list[tuple[str, float | None]]) -> list:
    """One row per (bench, method) over the selected problems that method has finished."""
    rows = []
    for bench, task_ids in selection.items():
        by_method = {}
        for r in records:
            if r["bench"] == bench and r["task_id"] in task_ids:
                by_method.setdefault(r["method"], {})[r["task_id"]] = r
        plain = by_method.get(PLAIN, {})
        for label, threshold in labels:
            done = by_method.get(label)
            if not done:
                continue
            rows.append({"bench": bench, "method": label, "threshold": threshold, **totals(done, plain)})
    return rows


def totals(done: dict[str, dict], plain: dict[str, dict]) -> dict:
    rs = list(done.values())
    tokens, seconds = sum(r["new_tokens"] for r in rs), sum(r["wall_time"] for r in rs)
    steps, accepted = sum(r["verify_steps"] for r in rs), sum(r["accepted"] for r in rs)
    row = {"problems": len(rs), "accuracy": sum(r["correct"] for r in rs) / len(rs),
           "tokens_per_s": tokens / seconds if seconds else None, "speedup": None,
           "tau": tokens_per_step(accepted, steps) if steps else None,
           "fuzzy_fraction": sum(r["fuzzy"] for r in rs) / accepted if accepted else 0.0,
           "new_tokens": tokens, "wall_time": round(seconds, 3)}
    shared = [t for t in done if t in plain]  # speedup only over problems plain decoding also ran
    if shared:
        run_tps = sum(done[t]["new_tokens"] for t in shared) / sum(done[t]["wall_time"] for t in shared)
        plain_tps = sum(plain[t]["new_tokens"] for t in shared) / sum(plain[t]["wall_time"] for t in shared)
        row["speedup"] = run_tps / plain_tps
    return row


def write_summary(out_dir: Path, rows: list[dict], settings: dict) -> None:
    with open(out_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row[k] is None else round(row[k], 4) if isinstance(row[k], float) else row[k])
                             for k in CSV_FIELDS})
    (out_dir / "summary.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")


def plot(out_dir: Path, rows: list[dict], title: str) -> Path:
    """sweep.png: accuracy against speedup; a line through the FSD points of each benchmark in T order, the
    lossless point as a star and plain decoding as a square (both exact: they should score alike)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for i, bench in enumerate(dict.fromkeys(r["bench"] for r in rows)):
        color = f"C{i}"
        mine = [r for r in rows if r["bench"] == bench and r["speedup"] is not None]
        fuzzy = sorted((r for r in mine if r["threshold"] is not None), key=lambda r: r["threshold"])
        ax.plot([r["speedup"] for r in fuzzy], [r["accuracy"] for r in fuzzy], "o-", color=color,
                label=f"{bench}: FSD")
        labels: dict[tuple[float, float], list[str]] = {}  # thresholds that landed on the same point share a label
        for r in fuzzy:
            labels.setdefault((round(r["speedup"], 2), r["accuracy"]), []).append(f"{r['threshold']:g}")
        for (speedup, accuracy), thresholds in labels.items():
            ax.annotate("T=" + ", ".join(thresholds), (speedup, accuracy), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        for r in mine:
            if r["method"] == LOSSLESS:
                ax.plot(r["speedup"], r["accuracy"], "*", color=color, markersize=14, markeredgecolor="k",
                        label=f"{bench}: lossless")
            elif r["method"] == PLAIN:
                ax.plot(r["speedup"], r["accuracy"], "s", color=color, markersize=8, markeredgecolor="k",
                        label=f"{bench}: plain decoding")
    ax.set_xlabel("speedup over plain decoding (tokens/s ratio)")
    ax.set_ylabel("accuracy (HumanEval pass@1 / GSM8K exact match)")
    ax.set_ylim(-0.03, 1.03)  # a fraction: a fixed scale keeps plots of different sweeps comparable
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = out_dir / "sweep.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_rows(rows: list[dict]) -> None:
    print(f"{'bench':<10}{'method':<12}{'n':>5}{'accuracy':>10}{'tok/s':>9}{'speedup':>9}{'tau':>7}{'fuzzy':>7}")
    for r in rows:
        def f(key, spec=".2f"):
            return "-" if r[key] is None else format(r[key], spec)
        print(f"{r['bench']:<10}{r['method']:<12}{r['problems']:>5}{f('accuracy', '.3f'):>10}{f('tokens_per_s'):>9}"
              f"{f('speedup'):>8}x{f('tau'):>7}{f('fuzzy_fraction'):>7}")


# ---------------------------------------------------------------- main
def settings_of(settings: Settings) -> dict:
    """What must not change within one out-dir (thresholds, benches and --limit may: records are per T/problem)."""
    m, tree, gen, fsd = settings.model, settings.tree, settings.generation, settings.fsd
    return {"model": m.model, "drafter": m.drafter, "ea_model_path": m.ea_model_path, "dtype": m.dtype,
            "total_token": tree.total_token, "depth": tree.depth, "top_k": tree.top_k,
            "max_new_token": gen.max_new_tokens, "temperature": gen.temperature, "top_p": gen.top_p,
            "conv_template": m.conv_template, "fsd_divergence": fsd.divergence, "fsd_mode": fsd.mode}


def prepare_out_dir(job: SweepJob) -> list[dict]:
    """The records already there (with --resume) after checking they were made with the same settings."""
    out, settings = job.out_dir, settings_of(job.settings)
    out.mkdir(parents=True, exist_ok=True)
    records_path, settings_path = out / "records.jsonl", out / "settings.json"
    records = read_answers(records_path, repair=job.resume)
    if records and not job.resume:
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


def parse_args(argv) -> SweepJob:
    p = argparse.ArgumentParser(prog="eagle-fsd sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, max_new_default=512, baseline_flag=False)  # plain decoding is always one of the rows
    add_fsd_args(p, threshold_flag=False)  # --thresholds instead
    p.add_argument("--bench", nargs="+", choices=sorted(BENCHES), default=["humaneval"])
    p.add_argument("--thresholds", default="0.1,0.3,1,3", help="comma-separated FSD thresholds T")
    p.add_argument("--limit", type=int, default=None, help="the first N problems of each benchmark")
    p.add_argument("--out-dir", type=Path, default=Path("sweep_out"))
    p.add_argument("--resume", action="store_true", help="skip (method, problem) pairs already in the out-dir")
    p.add_argument("--exec-timeout", type=float, default=humaneval.DEFAULT_TIMEOUT,
                   help="seconds a HumanEval program may run")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    args = p.parse_args(argv)
    settings = parse_settings(p, args)
    if args.limit is not None and args.limit <= 0:
        p.error(f"--limit {args.limit}: must be a positive number of problems")
    return SweepJob(settings, args.bench, parse_thresholds(args.thresholds), args.out_dir, args.limit, args.resume,
                    args.exec_timeout, args.warmup)


def run_todo(job: SweepJob, todo: list, records: list[dict]) -> None:
    """Generate and score every (bench, problem, method) left, appending each record as soon as it is scored."""
    from tqdm import tqdm

    model = load_model(job.settings)
    fmt = PromptFormat(model.tokenizer, job.settings.model.conv_template)
    if job.warmup:
        warm_up(model, job.settings.generation, job.settings.fsd, fmt)
    bar = tqdm(todo, unit="run", dynamic_ncols=True)
    try:
        for bench, problem, label, threshold in bar:
            bar.set_description(f"{bench} {label}")
            record = solve(model, fmt, bench, problem, job, label, threshold)
            append_record(job.out_dir / "records.jsonl", record)
            records.append(record)
    except KeyboardInterrupt:  # the results so far still make a summary and a plot
        print(f"\ninterrupted: the finished runs are in {job.out_dir / 'records.jsonl'}; add --resume to continue")
    finally:
        bar.close()


def main(argv=None) -> int:
    job = parse_args(argv)
    labels = methods(job.thresholds)
    problems = {bench: BENCHES[bench].load_problems(job.limit) for bench in job.benches}
    records = prepare_out_dir(job)
    done = {(r["bench"], r["method"], r["task_id"]) for r in records}
    todo = [(bench, p, label, t) for bench, ps in problems.items() for p in ps for label, t in labels
            if (bench, label, p["task_id"]) not in done]
    if done:
        print(f"resuming {job.out_dir}: {len(done)} results there, {len(todo)} to go")
    if todo:
        run_todo(job, todo, records)
    selection = {bench: [p["task_id"] for p in ps] for bench, ps in problems.items()}
    rows = summarize(records, selection, labels)
    settings = job.settings
    write_summary(job.out_dir, rows, settings_of(settings))
    png = plot(job.out_dir, rows, f"{settings.model.model} ({settings.fsd.divergence}, {settings.fsd.mode}), "
                                  f"temperature {settings.generation.temperature:g}")
    print_rows(rows)
    print(f"wrote {job.out_dir / 'summary.csv'}, {job.out_dir / 'summary.json'} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
