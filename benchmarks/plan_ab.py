"""Outputs and speed of one install of eagle-fsd through its public API, to compare two versions on one machine in
one sitting: the preset at all defaults (dtype, weights, tree all "auto"), MT-Bench first turns q81-90, 128 new
tokens, 2 threads; plain decoding, lossless speculation and FSD kl_qp T = 2, question by question in turn.

    python benchmarks/plan_ab.py after.json                  # this checkout's install
    /tmp/venv-before/bin/python benchmarks/plan_ab.py before.json   # another version's install
    python benchmarks/plan_ab.py --compare before.json after.json
    python benchmarks/plan_ab.py after.json 5,3,1,37888      # the tree pinned (no tuning, no speed guard)

Writes {method: {"tokens": [[ids] per question], "seconds": [...], "tau": [...]}} and prints tokens/s per method.
"""
from __future__ import annotations

import json
import sys
import time

import torch

QUESTIONS, NEW_TOKENS, THREADS = 10, 128, 2


def measure(path: str, tree: str | None = None) -> None:
    from eagle_fsd.eval.data import load_questions
    from eagle_fsd.fsd import FsdConfig
    from eagle_fsd.model import EaFsdModel
    from eagle_fsd.prompts import PromptFormat

    torch.set_num_threads(THREADS)
    pinned = dict(zip(("total_token", "depth", "top_k", "draft_vocab"), map(int, tree.split(",")))) if tree else {}
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", **pinned)
    fmt = PromptFormat(model.tokenizer)
    prompts = [fmt.encode([{"role": "user", "content": q["turns"][0]}]) for q in load_questions()[:QUESTIONS]]
    fsd = FsdConfig(threshold=2.0, divergence="kl_qp")
    methods = {"plain": lambda ids: model.naive_generate(ids, max_new_tokens=NEW_TOKENS, return_dict=True),
               "lossless": lambda ids: model.generate(ids, max_new_tokens=NEW_TOKENS, return_dict=True),
               "fsd kl_qp T=2": lambda ids: model.generate(ids, max_new_tokens=NEW_TOKENS, fsd=fsd, return_dict=True)}
    for run in methods.values():  # warm-up
        run(prompts[0][:, :16])
    results = {name: {"tokens": [], "seconds": [], "tau": []} for name in methods}
    for ids in prompts:
        for name, run in methods.items():
            start = time.perf_counter()
            out = run(ids)
            results[name]["seconds"].append(time.perf_counter() - start)
            results[name]["tokens"].append(out.sequences[0, ids.shape[1]:].tolist())
            results[name]["tau"].append(out.tau)
    with open(path, "w") as f:
        json.dump(results, f)
    for name, r in results.items():
        new = sum(len(t) for t in r["tokens"])
        print(f"{name:>14}: {new / sum(r['seconds']):6.2f} tok/s, tau {sum(r['tau']) / len(r['tau']):.2f}")


def compare(before_path: str, after_path: str) -> None:
    before, after = (json.load(open(p)) for p in (before_path, after_path))
    for name in before:
        same = sum(a == b for a, b in zip(before[name]["tokens"], after[name]["tokens"]))
        rates = [sum(len(t) for t in r[name]["tokens"]) / sum(r[name]["seconds"]) for r in (before, after)]
        print(f"{name:>14}: identical {same}/{len(before[name]['tokens'])}, tok/s {rates[0]:.2f} -> {rates[1]:.2f} "
              f"({rates[1] / rates[0]:.3f}x)")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        measure(*sys.argv[1:3])
