"""The `eagle-fsd` command: run (the main job), models, bench, mtbench, speed, sweep, chat, train-head."""
from __future__ import annotations

import argparse
import importlib
import sys

import torch

COMMANDS = {  # name -> (module with a main(argv) -> int, one-line help)
    "run": ("eagle_fsd.cli", "generate with speculative decoding, then plain decoding; print speed, tau, speedup"),
    "models": ("eagle_fsd.presets:main_models", "list / fetch the offline model presets"),
    "bench": ("eagle_fsd.eval.bench", "speed benchmark: plain vs HF assisted vs eagle-fsd (and FSD rows)"),
    "mtbench": ("eagle_fsd.eval.mtbench", "answer MT-Bench questions (FastChat answer jsonl)"),
    "speed": ("eagle_fsd.eval.speed", "speed report of an answer jsonl (tokens/s, speedup, tau, acceptance)"),
    "sweep": ("eagle_fsd.eval.sweep", "quality vs speed over FSD thresholds (HumanEval / GSM8K)"),
    "chat": ("eagle_fsd.chat", "interactive chat with live speed statistics"),
    "train-head": ("eagle_fsd.train", "train an EAGLE-1/2 head for a causal LM"),
}
DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime, with a docstring and two examples."


def run_main(argv=None) -> int:
    from transformers import TextStreamer

    from eagle_fsd.eval.bench import DTYPES
    from eagle_fsd.fsd import FsdConfig
    from eagle_fsd.model import EaFsdModel

    p = argparse.ArgumentParser(prog="eagle-fsd run", description=COMMANDS["run"][1])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="preset name, hub id or directory")
    p.add_argument("--drafter", default=None, help="LM drafter sharing the tokenizer (default: the preset's)")
    p.add_argument("--ea-model-path", default=None, help="EAGLE-1/2 head directory or hub id")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--total-token", type=int, default=None, help="tree nodes incl. root (default 60 on GPU, 24 on CPU)")
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", type=int, default=None, help="branching (default 10 on GPU, 4 on CPU)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--attention", choices=["auto", "sdpa", "triton"], default="auto")
    p.add_argument("--fsd-threshold", type=float, default=None, help="FSD threshold T (default: lossless)")
    p.add_argument("--fsd-divergence", default="kl_qp")
    p.add_argument("--fsd-mode", default="reducible", choices=["reducible", "original"])
    p.add_argument("--no-baseline", action="store_true", help="skip the plain-decoding comparison")
    args = p.parse_args(argv)
    # EAGLE's GPU tree (60 nodes) is too big for a CPU, where verification cost grows with the tree (BENCHMARKS.md).
    gpu = torch.cuda.is_available()
    args.total_token = args.total_token or (60 if gpu else 24)
    args.top_k = args.top_k or (10 if gpu else 4)
    FsdConfig(args.fsd_threshold, args.fsd_divergence, args.fsd_mode)  # bad settings fail before loading models

    model = EaFsdModel.from_pretrained(args.model, ea_model_path=args.ea_model_path, draft_model=args.drafter,
                                       total_token=args.total_token, depth=args.depth, top_k=args.top_k,
                                       dtype=DTYPES[args.dtype], attention=args.attention)
    if model.drafter is None:
        raise SystemExit(f"{args.model} has no default drafter: pass --drafter MODEL or --ea-model-path HEAD")
    tok = model.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"].to(model.base_model.device)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
    model.generate(ids[:, :8], max_new_tokens=4)  # warm-up
    print(f"\n>>> {args.prompt}\n")
    out = model.generate(ids, streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True),
                         return_dict=True, fsd_threshold=args.fsd_threshold, fsd_divergence=args.fsd_divergence,
                         fsd_mode=args.fsd_mode, **sampling)
    speed = out.new_tokens / out.wall_time
    print(f"\neagle-fsd: {out.new_tokens} tokens in {out.wall_time:.2f} s = {speed:.2f} tokens/s, "
          f"tau = {out.tau:.2f} tokens per target forward ({out.verify_steps} verification steps)")
    if args.fsd_threshold is not None:
        print(f"fsd {args.fsd_divergence} T={args.fsd_threshold:g}: fuzzy fraction {out.fuzzy_fraction:.2f}")
    if not args.no_baseline:
        print("plain decoding of the same prompt (the target alone, one token per forward)...", flush=True)
        plain = model.naive_generate(ids, return_dict=True, **sampling)
        plain_speed = plain.new_tokens / plain.wall_time
        same = "identical output" if torch.equal(plain.sequences, out.sequences) else "different output"
        print(f"plain:     {plain.new_tokens} tokens in {plain.wall_time:.2f} s = {plain_speed:.2f} tokens/s")
        print(f"speedup:   {speed / plain_speed:.2f}x ({same})")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: eagle-fsd COMMAND [ARGS]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<11} {help_text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    module, _, func = COMMANDS[name][0].partition(":")
    entry = run_main if name == "run" else getattr(importlib.import_module(module), func or "main")
    try:
        return entry(rest) or 0
    except (ValueError, FileNotFoundError) as err:  # bad input: say what and how to fix it, no traceback
        print(f"eagle-fsd {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
