"""Speed benchmark: plain greedy vs HF assisted generation vs this engine (lossless and FSD), one process.

    python -m eagle_fsd.eval.bench --model qwen2.5-coder-1.5b-instruct --questions 10
    python -m eagle_fsd.eval.bench --model smollm2-135m-instruct --drafter-layers 8
    python -m eagle_fsd.eval.bench ... --fsd kl_qp:0.5,2 --fsd tv:0.3   # FSD sweep rows

Every method runs on the same MT-Bench first turns, question by question in turn (so slow drift of the machine hits
all methods alike); ratios are total tokens / total seconds against plain greedy decoding through the same loop.
τ = tokens per target forward, bonus included.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from eagle_fsd.eval.data import load_questions
from eagle_fsd.eval.mtbench import PromptFormat
from eagle_fsd.model import EaFsdModel

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_fsd(specs: list[str]) -> list[tuple[str, float]]:
    """["kl_qp:0.5,2", "tv:0.3"] -> [("kl_qp", 0.5), ("kl_qp", 2.0), ("tv", 0.3)]"""
    rows = []
    for spec in specs:
        name, _, values = spec.partition(":")
        if not values:
            raise SystemExit(f"--fsd {spec!r}: expected DIVERGENCE:T1,T2,... e.g. kl_qp:0.5,2")
        rows += [(name, float(v)) for v in values.split(",")]
    return rows


class PhaseTimer:
    """Wall time per engine phase (draft, verify, accept, cache), measured by wrapping the model's step functions."""

    def __init__(self, model: EaFsdModel):
        self.seconds = defaultdict(float)
        import eagle_fsd.model as engine

        self._wrap(engine, "grow_tree", "draft")
        self._wrap(model.drafter, "extend", "draft")
        self._wrap(model, "_verify", "verify")
        self._wrap(model, "_accept", "accept")
        self._wrap(engine.TreeCache, "keep", "cache")

    def _wrap(self, owner, name, phase):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(owner, name, timed)


def prompts(tokenizer, n: int, path=None) -> list[torch.Tensor]:
    """The first turns of the first n questions, through the model's chat template."""
    fmt = PromptFormat(tokenizer)
    return [fmt.encode([{"role": "user", "content": q["turns"][0]}]) for q in load_questions(path)[:n]]


def run(args) -> dict:
    torch.manual_seed(0)
    model = EaFsdModel.from_pretrained(args.model, ea_model_path=args.ea_model_path, draft_model=args.drafter,
                                       total_token=args.total_token, depth=args.depth, top_k=args.top_k,
                                       dtype=DTYPES[args.dtype])
    if args.drafter_layers:  # the target's first N layers as an LM drafter (a parity baseline, accepts little)
        from transformers import AutoModelForCausalLM

        from eagle_fsd import presets
        from eagle_fsd.drafters import LMDrafter

        small = AutoModelForCausalLM.from_pretrained(presets.resolve_model(args.model), dtype=DTYPES[args.dtype],
                                                     num_hidden_layers=args.drafter_layers,
                                                     attn_implementation="eagle_fsd").eval()
        model.drafter = LMDrafter(small, model.base_model.config.vocab_size)
    ids_list = prompts(model.tokenizer, args.questions, args.question_file)
    methods = {"plain": lambda ids: model.naive_generate(ids, max_new_tokens=args.max_new_tokens, return_dict=True)}
    assistant = getattr(model.drafter, "model", None)
    if args.hf_assisted and assistant is not None and not args.drafter_layers:
        def hf_assisted(ids):
            start = time.perf_counter()
            seq = model.base_model.generate(ids, assistant_model=assistant, do_sample=False,
                                            max_new_tokens=args.max_new_tokens)
            return {"sequences": seq, "wall_time": time.perf_counter() - start}
        methods["hf-assisted"] = hf_assisted
    methods["eagle-fsd"] = lambda ids: model.generate(ids, max_new_tokens=args.max_new_tokens, return_dict=True)
    for name, threshold in parse_fsd(args.fsd):
        methods[f"fsd {name} T={threshold:g}"] = (lambda name, t: lambda ids: model.generate(
            ids, max_new_tokens=args.max_new_tokens, fsd_threshold=t, fsd_divergence=name, fsd_mode=args.fsd_mode,
            return_dict=True))(name, threshold)

    timer = PhaseTimer(model) if args.profile else None
    model.generate(ids_list[0][:, :16], max_new_tokens=8)  # warm-up
    model.naive_generate(ids_list[0][:, :16], max_new_tokens=8)
    totals = {m: defaultdict(float) for m in methods}
    plain_outputs = []
    for qi, ids in enumerate(ids_list):
        for name, fn in methods.items():
            if timer is not None and name != "eagle-fsd":
                saved, timer.seconds = timer.seconds, defaultdict(float)
            out = fn(ids)
            if timer is not None and name != "eagle-fsd":
                timer.seconds = saved
            seq = out["sequences"] if isinstance(out, dict) else out.sequences
            wall = out["wall_time"] if isinstance(out, dict) else out.wall_time
            t = totals[name]
            t["tokens"] += seq.shape[1] - ids.shape[1]
            t["seconds"] += wall
            if not isinstance(out, dict):
                t["steps"] += out.verify_steps
                t["accepted"] += sum(out.accept_lengths)
                t["fuzzy"] += sum(out.fuzzy_accepts)
            if name == "plain":
                plain_outputs.append(seq)
            elif not name.startswith("fsd"):
                t["identical"] += int(torch.equal(seq, plain_outputs[qi]))
        print(f"question {qi + 1}/{len(ids_list)} done", flush=True)

    base = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    rows = []
    for name, t in totals.items():
        tps = t["tokens"] / t["seconds"]
        row = {"method": name, "tokens": int(t["tokens"]), "seconds": round(t["seconds"], 2),
               "tokens_per_s": round(tps, 3), "speedup": round(tps / base, 3)}
        if t["steps"]:
            row["tau"] = round((t["accepted"] + t["steps"]) / t["steps"], 3)
            row["fuzzy_fraction"] = round(t["fuzzy"] / max(t["accepted"], 1), 3)
        if name in ("hf-assisted", "eagle-fsd"):
            row["identical_to_plain"] = f"{int(t['identical'])}/{len(ids_list)}"
        rows.append(row)
    from eagle_fsd.presets import drafter_label

    drafter = (f"its first {args.drafter_layers} layers" if args.drafter_layers else
               args.ea_model_path or args.drafter or drafter_label(args.model))
    result = {"model": args.model, "drafter": drafter,
              "dtype": args.dtype, "questions": len(ids_list), "max_new_tokens": args.max_new_tokens,
              "tree": [args.total_token, args.depth, args.top_k], "threads": torch.get_num_threads(), "rows": rows}
    if timer is not None:
        result["eagle_fsd_phase_seconds"] = {k: round(v, 2) for k, v in timer.seconds.items()}
    return result


def print_table(result: dict) -> None:
    print(f"\n{result['model']} + {result['drafter']}, {result['dtype']}, {result['questions']} MT-Bench first turns, "
          f"{result['max_new_tokens']} new tokens, tree (total_token, depth, top_k) = {tuple(result['tree'])}")
    print(f"{'method':<22}{'tok/s':>8}{'speedup':>9}{'tau':>7}{'fuzzy':>7}{'same as plain':>15}")
    for r in result["rows"]:
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        fuzzy = f"{r['fuzzy_fraction']:.2f}" if "fuzzy_fraction" in r else "-"
        print(f"{r['method']:<22}{r['tokens_per_s']:>8.2f}{r['speedup']:>8.2f}x{tau:>7}{fuzzy:>7}"
              f"{r.get('identical_to_plain', '-'):>15}")
    if "eagle_fsd_phase_seconds" in result:
        print("eagle-fsd time by phase (s):", result["eagle_fsd_phase_seconds"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="eagle-fsd bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default=None, help="LM drafter (preset, dir or hub id); default: the preset's")
    p.add_argument("--ea-model-path", default=None, help="EAGLE-1/2 head (dir or hub id)")
    p.add_argument("--drafter-layers", type=int, default=0, help="draft with the target's first N layers")
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--question-file", default=None, help="FastChat question.jsonl (default: MT-Bench)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--total-token", type=int, default=60)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--no-hf-assisted", dest="hf_assisted", action="store_false")
    p.add_argument("--fsd", action="append", default=[], help="DIVERGENCE:T1,T2,... (repeatable)")
    p.add_argument("--fsd-mode", default="reducible", choices=["reducible", "original"])
    p.add_argument("--profile", action="store_true", help="time the engine's phases")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
