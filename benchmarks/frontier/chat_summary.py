"""Per-arm figures of a label-free chat run (`eagle-fsd calibrate --prompts ...` records, OUT_DIR/nll.jsonl), paired
against lossless on the same prompts: time per answer × lossless [95 % CI], tokens/s × lossless, reply length ×
lossless, replies at the token limit, the target's extra NLL per token [95 % CI], the fuzzy share, and the trees run.

    python benchmarks/frontier/chat_summary.py benchmarks/frontier/qwen-defaults/mtbench-lossless-tree --limit 256
"""
import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

from eagle_fsd.eval.calibrate import extra_nll
from eagle_fsd.eval.stats import paired_answer_time


def rows(records: list[dict], limit: int) -> list[dict]:
    table = defaultdict(dict)
    for r in records:
        table[r["method"]][r["prompt"]] = r
    base = table["lossless"]
    out = []
    for method, mine in table.items():
        shared = [k for k in mine if k in base]
        seconds = [mine[k]["wall_time"] for k in shared]
        base_seconds = [base[k]["wall_time"] for k in shared]
        tokens, base_tokens = sum(mine[k]["tokens"] for k in shared), sum(base[k]["tokens"] for k in shared)
        nll = extra_nll({k: (base[k]["nll"], base[k]["tokens"]) for k in shared},
                        {k: (mine[k]["nll"], mine[k]["tokens"]) for k in shared})
        trees = Counter()
        for k in shared:
            trees.update(mine[k].get("trees") or {})
        out.append({"method": method, "prompts": len(shared),
                    "answer_time": paired_answer_time(seconds, base_seconds),
                    "tokens_per_s": (tokens / sum(seconds)) / (base_tokens / sum(base_seconds)),
                    "length": tokens / base_tokens,
                    "at_limit": sum(mine[k]["tokens"] >= limit for k in shared) / len(shared),
                    "extra_nll": nll,
                    "fuzzy": sum(mine[k]["fuzzy"] for k in shared) / max(sum(mine[k].get("accepted", 0)
                                                                             for k in shared), 1),
                    "trees": dict(trees)})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir", type=Path)
    p.add_argument("--limit", type=int, default=256, help="the run's max new tokens")
    args = p.parse_args()
    records = [json.loads(line) for line in (args.out_dir / "nll.jsonl").read_text().splitlines() if line.strip()]
    print("| arm | prompts | time per answer × lossless [95 % CI] | tok/s × lossless | length × | at limit | "
          "extra NLL nats/token [95 % CI] | fuzzy share |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows(records, args.limit):
        t, nll = r["answer_time"], r["extra_nll"]
        print(f"| {r['method']} | {r['prompts']} | {t[0]:.2f}× [{t[1]:.2f}, {t[2]:.2f}] | {r['tokens_per_s']:.2f}× | "
              f"{r['length']:.2f}× | {r['at_limit']:.2f} | {nll[0]:+.3f} [{nll[1]:+.3f}, {nll[2]:+.3f}] | "
              f"{r['fuzzy']:.2f} |" + (f" trees {r['trees']}" if r["trees"] else ""))


if __name__ == "__main__":
    main()
