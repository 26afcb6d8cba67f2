"""Speed report of an answer jsonl written by `eagle-fsd mtbench` (or EAGLE's gen_ea_answer_*).

    eagle-fsd speed RUN.jsonl [--baseline BASE.jsonl] [--json [PATH]]

tokens/s = total new tokens / total generation seconds over all turns. speedup = that over the baseline's, both
taken over the questions the two files share. tau = tokens per target forward, bonus token included:
sum(accept_length + 1) / verify steps (EAGLE's sum(new_tokens) / sum(idxs + 1) for EAGLE's files, which carry no
accept lengths). Acceptance at depth d = P(draft token at depth d accepted | its parent was), pooled over steps.
fuzzy fraction = share of the accepted draft tokens that only the FSD rule accepted.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from eagle_fsd.eval.mtbench import read_answers
from eagle_fsd.tree.accept import acceptance_by_depth, tokens_per_step


def per_turn(choice: dict, key: str, path: Path, qid) -> list:
    if key not in choice:
        raise SystemExit(f"{path}: question {qid} has no per-turn {key!r}; speed needs an answer file written by "
                         "`eagle-fsd mtbench` (or EAGLE's gen_*_answer scripts)")
    return choice[key]


def turn_rows(records: list[dict], path: Path) -> dict:
    """question_id -> per-turn rows (new_tokens, wall_time, steps, accept_lengths or None, fuzzy or None)."""
    rows = {}
    for r in records:
        c, qid = r["choices"][0], r["question_id"]
        tokens, walls = per_turn(c, "new_tokens", path, qid), per_turn(c, "wall_time", path, qid)
        if "verify_steps" in c:
            steps = c["verify_steps"]
        elif "idxs" in c:
            steps = [i + 1 for i in c["idxs"]]  # EAGLE: idx is the 0-based index of the last round
        else:
            steps = [None] * len(tokens)
        accepts = c.get("accept_lengths", [None] * len(tokens))
        fuzzy = c.get("fuzzy_accepts", [None] * len(tokens))
        rows[qid] = list(zip(tokens, walls, steps, accepts, fuzzy))
    return rows


def summarize(rows: dict, ids=None) -> dict:
    """Totals over the questions `ids` (default: all)."""
    turns = [t for qid, ts in rows.items() if ids is None or qid in ids for t in ts]
    tokens = sum(t[0] for t in turns)
    seconds = sum(t[1] for t in turns)
    out = {"questions": len(rows) if ids is None else len(ids), "turns": len(turns), "new_tokens": tokens,
           "wall_time": round(seconds, 4), "tokens_per_s": tokens / seconds if seconds > 0 else None}
    if turns and all(t[2] is not None for t in turns):
        out["verify_steps"] = sum(t[2] for t in turns)
    if turns and all(t[3] is not None for t in turns):
        lengths = [a for t in turns for a in t[3]]
        steps = len(lengths)
        out["verify_steps"] = steps
        out["tau"] = tokens_per_step(sum(lengths), steps) if steps else None
        out["acceptance_by_depth"] = acceptance_by_depth(lengths)
        out["accept_length_histogram"] = {str(k): v for k, v in sorted(Counter(lengths).items())}
        if all(t[4] is not None for t in turns):
            out["fuzzy_fraction"] = sum(f for t in turns for f in t[4]) / max(sum(lengths), 1)
    elif out.get("verify_steps"):
        out["tau"] = tokens / out["verify_steps"]  # EAGLE's own files: prefill token counted, as EAGLE does
    return out


def report(run_path: Path, baseline_path: Path | None = None) -> dict:
    records = read_answers(run_path)
    if not records:
        raise SystemExit(f"{run_path} holds no answers")
    rows = turn_rows(records, run_path)
    result = {"file": str(run_path), "model_id": records[0].get("model_id"), **summarize(rows)}
    if baseline_path is not None:
        base_rows = turn_rows(read_answers(baseline_path), baseline_path)
        common = set(rows) & set(base_rows)
        if not common:
            raise SystemExit(f"{run_path} and {baseline_path} share no question_id: run both on the same questions")
        run_common, base_common = summarize(rows, common), summarize(base_rows, common)
        result["baseline"] = {"file": str(baseline_path), "questions": len(common),
                              "tokens_per_s": base_common["tokens_per_s"]}
        result["speedup"] = run_common["tokens_per_s"] / base_common["tokens_per_s"]
        if len(common) < len(rows) or len(common) < len(base_rows):
            result["baseline"]["note"] = (f"speedup over the {len(common)} shared questions "
                                          f"({len(rows)} in the run, {len(base_rows)} in the baseline)")
    return result


def fmt(value, spec=".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(r: dict, out=None) -> None:
    w = (out or sys.stdout).write
    w(f"{r['file']}  ({r.get('model_id')})\n")
    w(f"  questions / turns      {r['questions']} / {r['turns']}\n")
    w(f"  new tokens / seconds   {r['new_tokens']} / {r['wall_time']:.2f}\n")
    w(f"  tokens/s               {fmt(r['tokens_per_s'])}\n")
    if "baseline" in r:
        b = r["baseline"]
        w(f"  baseline tokens/s      {fmt(b['tokens_per_s'])}  ({b['file']})\n")
        w(f"  speedup                {fmt(r['speedup'])}x\n")
        if "note" in b:
            w(f"                         {b['note']}\n")
    w(f"  tau (tokens/forward)   {fmt(r.get('tau'))}   over {r.get('verify_steps', '-')} verification steps\n")
    if "fuzzy_fraction" in r:
        w(f"  fuzzy fraction         {fmt(r['fuzzy_fraction'], '.3f')}\n")
    if r.get("acceptance_by_depth"):
        w("  acceptance by depth    " + "  ".join(f"d{d + 1}:{a:.2f}" for d, a in
                                               enumerate(r["acceptance_by_depth"])) + "\n")
    hist = r.get("accept_length_histogram")
    if hist:
        total = sum(hist.values())
        w("  accept length histogram (accepted draft tokens per step)\n")
        for k, v in hist.items():
            w(f"    {k:>3} {v:>7} {v / total:6.1%} {'#' * round(40 * v / total)}\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="eagle-fsd speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="answer jsonl of the method to measure")
    p.add_argument("--baseline", type=Path, default=None, help="answer jsonl of plain decoding (mtbench --baseline)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="JSON instead of the table (to stdout, or to PATH)")
    args = p.parse_args(argv)
    for path in (args.run, args.baseline):
        if path is not None and not path.is_file():
            raise SystemExit(f"answer file {path} does not exist")
    result = report(args.run, args.baseline)
    if args.json is None:
        print_table(result)
    elif args.json == "-":
        print(json.dumps(result, indent=1))
    else:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
