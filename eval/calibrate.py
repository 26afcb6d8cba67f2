"""Calibrate the FSD threshold to a quality budget: the largest T whose accuracy loss against lossless decoding stays
within BUDGET points, checked on problems it was not chosen on.

    eagle-fsd calibrate --model qwen2.5-coder-1.5b-instruct --bench humaneval --budget 1 --fsd kl_qp:0.3,1,3
    eagle-fsd calibrate --model ... --prompts my_prompts.txt --nll-bound 0.05 --fsd kl_qp:0.3,1,3   # no labels

With labels: the selected problems (as in `eagle-fsd sweep`: --limit / --sample) are split with --seed into a
calibration half and a held-out half. On the calibration half every candidate arm runs beside lossless; for each
(divergence, rule) the thresholds are tested in increasing order and the last one passes whose upper 95 % paired
bootstrap bound of the accuracy drop is within the budget (fixed-sequence testing: stopping at the first T that
fails keeps the chance of choosing a T whose true drop exceeds the budget near 2.5 %, however many T are listed).
The chosen T then runs on the held-out half, and both splits' drops are printed. Records go to OUT_DIR/records.jsonl
in the sweep's format, so an out-dir can be resumed, and a sweep's out-dir reused (--resume).

Without labels (--prompts: a text file, one prompt per line, or jsonl with "prompt"): each candidate's replies are
scored by the target itself: extra NLL = the target's mean negative log-likelihood per reply token of FSD's replies
minus that of lossless replies (greedy lossless replies are the target's own choices, so FSD can only add to it).
The chosen T is the last whose upper bound of the extra NLL (nats per token, paired bootstrap over prompts) is within
--nll-bound.

The choice is printed as the flags to pass back (--fsd-threshold T --fsd-divergence D --fsd-mode R), written to
OUT_DIR/calibration.json and appended, with the model pair, to <cache>/calibrations.jsonl.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from eagle_fsd.eval import sweep
from eagle_fsd.eval.mtbench import append_record, read_answers, warm_up_arms
from eagle_fsd.eval.stats import bootstrap_indices, paired_difference, percentile_interval
from eagle_fsd.files import cache_dir
from eagle_fsd.fsd import FsdConfig
from eagle_fsd.model import load_model
from eagle_fsd.prompts import PromptFormat, generate_reply
from eagle_fsd.settings import add_fsd_args, add_model_args, add_threads_arg, parse_settings


# ---------------------------------------------------------------- choosing T (pure)
@dataclass(frozen=True)
class Trial:
    """One candidate T on the calibration data: its loss (accuracy points, or nats per token) and upper bound."""

    threshold: float
    loss: float
    upper: float
    passed: bool


def fixed_sequence(losses: list[tuple[float, float, float]], budget: float) -> tuple[float | None, list[Trial]]:
    """losses: (T, loss, upper bound of the loss) per candidate. Tested in increasing T, stopping at the first whose
    upper bound exceeds the budget: (the last T that passed, or None, and the trials run)."""
    chosen, trials = None, []
    for threshold, loss, upper in sorted(losses):
        passed = upper <= budget
        trials.append(Trial(threshold, loss, upper, passed))
        if not passed:
            break
        chosen = threshold
    return chosen, trials


def accuracy_drop(lossless: dict, arm: dict, keys: list, confidence: float = 0.95) -> tuple[float, float, float]:
    """(drop, low, high) in accuracy points, lossless − arm, over the problems in `keys` both answered."""
    shared = [k for k in keys if k in lossless and k in arm]
    d = paired_difference([arm[k] for k in shared], [lossless[k] for k in shared], confidence)
    return 100 * d.difference, 100 * d.low, 100 * d.high


def choose_by_accuracy(scores: dict[str, dict], arms: list[sweep.Arm], keys: list, budget: float):
    """scores: {method: {problem key: correct}}. The last passing T per (divergence, rule) and its trials."""
    results = {}
    for family, members in families(arms).items():
        losses = [(a.fsd.threshold, *accuracy_drop(scores.get(sweep.LOSSLESS, {}), scores.get(a.label, {}), keys)[::2])
                  for a in members]
        results[family] = fixed_sequence(losses, budget)
    return results


def families(arms: list[sweep.Arm]) -> dict[tuple[str, str], list[sweep.Arm]]:
    """The FSD arms grouped by (divergence, rule); arms with guards (eagle_fsd.fsd) form families of their own, their
    divergence named with the guards ("kl_qp+stop")."""
    groups: dict[tuple[str, str], list[sweep.Arm]] = {}
    for arm in arms:
        if arm.fsd is not None:
            name = arm.fsd.divergence + sweep.guard_label(sweep.guards_of(arm.fsd))
            groups.setdefault((name, arm.fsd.mode), []).append(arm)
    return groups


def answer_time_ratios(times: dict[str, dict], members: list[sweep.Arm], keys: list) -> dict[float, float]:
    """{T: time per answer × lossless} of each arm over the problems in `keys` both answered: Σ lossless seconds /
    Σ the arm's (> 1: the arm finishes answers sooner)."""
    lossless, ratios = times.get(sweep.LOSSLESS, {}), {}
    for arm in members:
        shared = [k for k in keys if k in lossless and k in times.get(arm.label, {})]
        seconds = sum(times[arm.label][k] for k in shared)
        if shared and seconds:
            ratios[arm.fsd.threshold] = sum(lossless[k] for k in shared) / seconds
    return ratios


def recommended(trials: list[Trial], ratios: dict[float, float]) -> float | None:
    """Among the thresholds that passed, the one with the best time per answer (not tokens/s: replies that grow
    cost time); the largest passing T where none was timed, None where none passed."""
    passed = [t.threshold for t in trials if t.passed]
    timed = [t for t in passed if t in ratios]
    if timed:
        return max(timed, key=ratios.__getitem__)
    return passed[-1] if passed else None


def length_ratios(table: dict[str, dict], members: list[sweep.Arm]) -> dict[float, float]:
    """{T: reply tokens × lossless} of each arm over the prompts both answered. table: {method: {prompt: (nll,
    tokens)}}."""
    lossless, ratios = table.get(sweep.LOSSLESS, {}), {}
    for arm in members:
        mine = table.get(arm.label, {})
        shared = [k for k in mine if k in lossless]
        base = sum(lossless[k][1] for k in shared)
        if base:
            ratios[arm.fsd.threshold] = sum(mine[k][1] for k in shared) / base
    return ratios


def extra_nll(lossless: dict, arm: dict, confidence: float = 0.95) -> tuple[float, float, float]:
    """(extra, low, high): Σ nll / Σ tokens of the arm's replies minus that of lossless replies, per token, with a
    paired bootstrap interval over prompts. lossless / arm: {prompt: (nll_sum, tokens)}."""
    keys = [k for k in lossless if k in arm]
    if not keys:
        return float("nan"), float("nan"), float("nan")
    a = np.array([arm[k] for k in keys], dtype=float)
    b = np.array([lossless[k] for k in keys], dtype=float)
    idx = bootstrap_indices(len(keys))
    sampled = a[idx, 0].sum(1) / a[idx, 1].sum(1) - b[idx, 0].sum(1) / b[idx, 1].sum(1)
    low, high = percentile_interval(sampled, confidence)
    return float(a[:, 0].sum() / a[:, 1].sum() - b[:, 0].sum() / b[:, 1].sum()), low, high


def split(problems: dict[str, list[dict]], seed: int, fraction: float = 0.5) -> tuple[dict, dict]:
    """Each benchmark's problems cut at random (fixed by `seed`) into a calibration and a held-out part."""
    calibration, held_out = {}, {}
    for bench, ps in problems.items():
        order = random.Random(seed).sample(range(len(ps)), len(ps))
        cut = max(1, round(fraction * len(ps)))
        calibration[bench] = [ps[i] for i in sorted(order[:cut])]
        held_out[bench] = [ps[i] for i in sorted(order[cut:])]
    return calibration, held_out


# ---------------------------------------------------------------- running
@dataclass(frozen=True)
class CalibrateJob:
    """sweep: the model, benchmarks, problem selection, candidate arms and out-dir (plain decoding is not run);
    budget: accuracy points (with labels); prompts / nll_bound: the label-free mode instead."""

    sweep: sweep.SweepJob
    budget: float = 1.0
    prompts: Path | None = None
    nll_bound: float = 0.05


def run_arms(job: sweep.SweepJob, problems: dict, arms: list[sweep.Arm], records: list[dict], model) -> None:
    done = {(r["bench"], r["method"], r["task_id"]) for r in records}
    todo = sweep.pending(problems, arms, done, None)
    if todo:
        sweep.run_todo(replace(job, warmup=False), todo, records, model)


def scores_of(records: list[dict], field: str = "correct") -> dict[str, dict]:
    """{method: {(bench, task_id): record[field]}}."""
    table: dict[str, dict] = {}
    for r in records:
        table.setdefault(r["method"], {})[(r["bench"], r["task_id"])] = r[field]
    return table


def keys(problems: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """(bench, task_id) of every problem: how records are matched across arms."""
    return [(bench, p["task_id"]) for bench, ps in problems.items() for p in ps]


def calibrate_accuracy(job: CalibrateJob, model) -> dict:
    """Choose T per (divergence, rule) on the calibration split, then measure it on the held-out split."""
    sj = job.sweep
    candidates = [a for a in sj.arms if not a.plain]
    calibration, held_out = split(sweep.load_selection(sj), sj.seed)
    records = sweep.prepare_out_dir(sj.out_dir, sweep.settings_of(sj.settings), sj.resume)
    run_arms(sj, calibration, candidates, records, model)
    choices = choose_by_accuracy(scores_of(records), candidates, keys(calibration), job.budget)
    times = scores_of(records, "wall_time")
    speed = {family: answer_time_ratios(times, members, keys(calibration))
             for family, members in families(candidates).items()}
    chosen = [a for a in candidates if a.fsd is None
              or choices[(a.fsd.divergence, a.fsd.mode)][0] == a.fsd.threshold]
    run_arms(sj, held_out, chosen, records, model)
    scores, result = scores_of(records), []
    for (divergence, mode), (threshold, trials) in choices.items():
        entry = {"divergence": divergence, "mode": mode, "threshold": threshold, "budget_points": job.budget,
                 "calibration": [asdict(t) for t in trials], "calibration_problems": len(keys(calibration)),
                 "answer_time_vs_lossless": speed[(divergence, mode)],
                 "recommended": recommended(trials, speed[(divergence, mode)])}
        if threshold is not None:
            label = next(a.label for a in families(candidates)[(divergence, mode)] if a.fsd.threshold == threshold)
            drop, low, high = accuracy_drop(scores[sweep.LOSSLESS], scores[label], keys(held_out))
            entry.update(held_out_drop=drop, held_out_low=low, held_out_high=high,
                         held_out_problems=len(keys(held_out)), missed_by=max(drop - job.budget, 0.0))
        result.append(entry)
    return {"mode": "accuracy", "budget_points": job.budget, "choices": result}


@torch.no_grad()
def reply_nll(model, prompt_ids: torch.Tensor, reply_ids: torch.Tensor) -> float:
    """Σ −log p_target(reply token | prompt, earlier reply tokens), nats, raw distribution (temperature 1)."""
    target = model.base_model
    ids = torch.cat([prompt_ids, reply_ids], dim=1).to(target.device)
    logits = target(input_ids=ids, logits_to_keep=reply_ids.shape[1] + 1).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits[:, :model.vocab_size], dim=-1)
    return float(-logprobs.gather(1, reply_ids[0].to(logits.device)[:, None]).sum())


def read_prompts(path: Path) -> list[str]:
    if not path.is_file():
        raise SystemExit(f"--prompts {path}: no such file (a text file, one prompt per line, or jsonl with "
                         "\"prompt\")")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        return [json.loads(line)["prompt"] for line in lines]
    return lines


def calibrate_nll(job: CalibrateJob, model) -> dict:
    """Label-free: generate each prompt with lossless and every candidate, score replies with the target."""
    sj = job.sweep
    prompts = read_prompts(job.prompts)
    path = sj.out_dir / "nll.jsonl"
    sweep.prepare_out_dir(sj.out_dir, sweep.settings_of(sj.settings), sj.resume)
    records = read_answers(path, repair=sj.resume)
    done = {(r["prompt"], r["method"]) for r in records}
    fmt = PromptFormat(model.tokenizer, sj.settings.model.conv_template)
    from tqdm import tqdm

    arms = [a for a in sj.arms if not a.plain]
    if any((i, a.label) not in done for i in range(len(prompts)) for a in arms):
        warm_up_arms(model, sj.settings.generation, arms, fmt)
    for i, text in enumerate(tqdm(prompts, unit="prompt")):
        ids = fmt.encode([{"role": "user", "content": text}])
        for arm in arms:
            if (i, arm.label) in done:
                continue
            out = generate_reply(model, ids, sj.settings.generation, arm.fsd or FsdConfig(), fmt, shape=arm.shape)
            reply = out.sequences[:, ids.shape[1]:]
            record = {"prompt": i, "method": arm.label, "nll": reply_nll(model, ids, reply),
                      "tokens": reply.shape[1], "fuzzy": sum(out.fuzzy_accepts), "accepted": sum(out.accept_lengths),
                      "verify_steps": out.verify_steps, "wall_time": round(out.wall_time, 4),
                      "trees": out.tree_steps, "tree_switches": out.tree_switches, "tstamp": time.time()}
            append_record(path, record)
            records.append(record)
    table: dict[str, dict] = {}
    for r in records:
        table.setdefault(r["method"], {})[r["prompt"]] = (r["nll"], max(r["tokens"], 1))
    times = {m: {r["prompt"]: r["wall_time"] for r in records if r["method"] == m and "wall_time" in r}
             for m in table}
    result = []
    for (divergence, mode), members in families(arms).items():
        losses = [(a.fsd.threshold, *extra_nll(table[sweep.LOSSLESS], table[a.label])[::2]) for a in members]
        threshold, trials = fixed_sequence(losses, job.nll_bound)
        ratios = answer_time_ratios(times, members, list(range(len(prompts))))
        result.append({"divergence": divergence, "mode": mode, "threshold": threshold,
                       "nll_bound": job.nll_bound, "prompts": len(prompts), "trials": [asdict(t) for t in trials],
                       "answer_time_vs_lossless": ratios, "recommended": recommended(trials, ratios),
                       "length_vs_lossless": length_ratios(table, members)})
    return {"mode": "nll", "nll_bound": job.nll_bound, "choices": result}


def calibrate(job: CalibrateJob, model=None) -> dict:
    """Run the calibration (labels or not), write and record it; the result as written."""
    model = model if model is not None else load_model(job.sweep.settings)
    result = calibrate_nll(job, model) if job.prompts is not None else calibrate_accuracy(job, model)
    m = job.sweep.settings.model
    result.update(model=m.model, drafter=m.drafter or m.ea_model_path, dtype=m.dtype,
                  settings=sweep.settings_of(job.sweep.settings), benches=job.sweep.benches,
                  seed=job.sweep.seed, tstamp=time.time())
    (job.sweep.out_dir / "calibration.json").write_text(json.dumps(result, indent=1) + "\n")
    cache_dir().mkdir(parents=True, exist_ok=True)
    append_record(cache_dir() / "calibrations.jsonl", result)
    return result


def report(result: dict) -> None:
    unit = "points" if result["mode"] == "accuracy" else "nats/token"
    for c in result["choices"]:
        name = c["divergence"] + ("" if c["mode"] == "reducible" else f" ({c['mode']})")
        for t in c.get("calibration", c.get("trials")):
            print(f"  {name} T={t['threshold']:g}: loss {t['loss']:+.2f} {unit}, upper bound {t['upper']:+.2f} "
                  f"-> {'pass' if t['passed'] else 'fail (stop)'}")
        if c["threshold"] is None:
            print(f"{name}: no candidate T is within the budget: keep lossless decoding (or try smaller T)")
            continue
        print(f"{name}: --fsd-threshold {c['threshold']:g} --fsd-divergence {c['divergence']} --fsd-mode {c['mode']}"
              " (the largest T within the budget)")
        ratios = {float(t): r for t, r in c.get("answer_time_vs_lossless", {}).items()}
        if ratios:
            print("  time per answer x lossless: " + ", ".join(f"T={t:g} {r:.2f}x" for t, r in sorted(ratios.items()))
                  + f"; recommended: T={c['recommended']:g} (the passing T that finishes answers soonest)")
        if "held_out_drop" in c:
            verdict = "within the budget" if c["missed_by"] == 0 else f"missed the budget by {c['missed_by']:.2f}"
            print(f"  held-out ({c['held_out_problems']} problems): drop {c['held_out_drop']:+.2f} points "
                  f"[{c['held_out_low']:+.2f}, {c['held_out_high']:+.2f}], {verdict}")


def parse_args(argv) -> CalibrateJob:
    p = argparse.ArgumentParser(prog="eagle-fsd calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, max_new_default=512, baseline_flag=False)
    add_threads_arg(p)
    add_fsd_args(p, threshold_flag=False)
    p.add_argument("--budget", type=float, default=1.0, help="accuracy points FSD may cost (default 1)")
    p.add_argument("--bench", nargs="+", choices=sorted(sweep.BENCHES), default=["humaneval"])
    p.add_argument("--fsd", action="append", default=[], metavar="DIV[/RULE]:T1,T2",
                   help="candidate thresholds, e.g. kl_qp:0.3,1,3 (repeatable); default kl_qp:0.3,1,3,10")
    sweep.add_selection_args(p)
    p.add_argument("--prompts", type=Path, default=None, help="label-free: your own prompts (txt or jsonl)")
    p.add_argument("--nll-bound", type=float, default=0.05, help="label-free: extra target NLL per token (nats)")
    p.add_argument("--out-dir", type=Path, default=Path("calibrate_out"))
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    settings = parse_settings(p, args)
    sweep.check_counts(p, limit=args.limit, sample=args.sample)
    if not args.budget >= 0 or not args.nll_bound >= 0:
        p.error(f"--budget {args.budget} / --nll-bound {args.nll_bound}: must be >= 0")
    if args.prompts is not None and not args.prompts.is_file():
        p.error(f"--prompts {args.prompts}: no such file")
    arms = [a for a in sweep.arms_of(settings, None, args.fsd or ["kl_qp:0.3,1,3,10"]) if not a.plain]
    job = sweep.SweepJob(settings, args.bench, arms, args.out_dir, args.limit, args.sample, args.seed,
                         resume=args.resume)
    return CalibrateJob(job, args.budget, args.prompts, args.nll_bound)


def main(argv=None) -> int:
    job = parse_args(argv)
    result = calibrate(job)
    report(result)
    print(f"wrote {job.sweep.out_dir / 'calibration.json'}; recorded in {cache_dir() / 'calibrations.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
