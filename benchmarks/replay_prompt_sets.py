"""E[a + 1] of a few tree shapes by the tuner's exact greedy replay, on a chosen prompt set: the shipped calibration
prompts (the first --count of them) or MT-Bench's first turns (questions --first .. --first + --count), for the Qwen
preset and its 0.5B drafter as the engine loads them (no timing: the figures are the same on any quiet or busy
machine). What the tuner's estimate depends on: which prompts it replays, and how many tokens of each. With --head H
it also reports E[a + 1] over each continuation's first H replayed positions and over the rest (does an answer's
opening predict as well as what follows it?).

    python benchmarks/replay_prompt_sets.py calibration --count 2 --new-tokens 64
    python benchmarks/replay_prompt_sets.py mtbench --count 10 --new-tokens 128 --json out.json
"""
import argparse
import json

import torch

from eagle_fsd.eval.bench import prompts as mtbench_prompts
from eagle_fsd.model import EaFsdModel
from eagle_fsd.tune.measure import MAX_DEPTH, SIZES, TuneSettings, calibration_prompts, vocab_ids
from eagle_fsd.tune.replay import replay_prompts, tau_by_shape

SHAPES = [(3, 1, 1), (4, 2, 1), (5, 3, 1), (4, 1, 2), (5, 1, 2), (5, 2, 2), (5, 1, 4)]  # (n, d, k)
TOP_KS, VOCABS = (1, 2, 4), (0, 37888)


def shapes_tau(rows, continuations, vocabs) -> dict:
    tau, _ = tau_by_shape(rows, continuations, vocabs, TOP_KS, MAX_DEPTH)
    return {f"{n}/{d}/{k}/{v}": round(tau[(n, d, k, v)], 3) for n, d, k in SHAPES for v in VOCABS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", choices=("calibration", "mtbench"))
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--head", type=int, default=0, help="also E[a + 1] over the first H positions and the rest")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", total_token=3, depth=1, top_k=1, draft_vocab=0,
                                       tune_progress=False)
    if args.prompts == "calibration":
        ids = [x[0] for x in calibration_prompts(model.tokenizer, args.first + args.count)][args.first:]
    else:
        ids = [x[0] for x in mtbench_prompts(model.tokenizer, args.first + args.count)][args.first:]
    settings = TuneSettings(new_tokens=args.new_tokens)
    biggest_pool = max(k + MAX_DEPTH * k * k for k in TOP_KS) + 1  # as the tuner bounds the tree sizes it replays
    sizes = tuple(sorted({1} | {n for n in SIZES if n <= biggest_pool}))
    vocabs = {v: (vocab_ids(model, v) if v else None) for v in VOCABS}
    with torch.no_grad():
        plain = [model.naive_generate(x[None], max_new_tokens=args.new_tokens, return_dict=True) for x in ids]
        rows, _, continuations = replay_prompts(model, ids, plain, TOP_KS, settings, sizes, progress=True)
    result = {"prompts": args.prompts, "first": args.first, "count": len(ids), "new_tokens": args.new_tokens,
              "positions": sum(len(r) for r in rows), "tau": shapes_tau(rows, continuations, vocabs)}
    if args.head:  # rows[j] is position j of a continuation: a window keeps rows and continuation aligned
        head = [(r[:args.head], g[:args.head + MAX_DEPTH + 1]) for r, g in zip(rows, continuations)]
        tail = [(r[args.head:], g[args.head:]) for r, g in zip(rows, continuations) if len(r) > args.head]
        for name, window in (("head", head), ("tail", tail)):
            result[f"{name}_positions"] = sum(len(r) for r, _ in window)
            result[f"tau_{name}"] = shapes_tau([r for r, _ in window], [g for _, g in window], vocabs)
    # per prompt: how far one prompt's acceptance sits from the set's (what a few prompts' estimate swings by)
    result["tau_per_prompt"] = [shapes_tau([r], [g], vocabs) for r, g in zip(rows, continuations)]
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
