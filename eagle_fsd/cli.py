"""The `eagle-fsd` command: run (the main job), models, bench, mtbench, speed, sweep, chat, train-head."""
from __future__ import annotations

import argparse
import importlib
import sys

import torch

COMMANDS = {  # name -> (module with a main(argv) -> int, one-line help)
    "run": ("eagle_fsd.cli", "generate with speculative decoding, then plain decoding; print speed, tau, speedup"),
    "models": ("eagle_fsd.presets:main_models", "list / fetch the offline model presets"),
    "tune": ("eagle_fsd.tune", "measure the speculation cost model on this machine; print the best tree shapes"),
    "bench": ("eagle_fsd.eval.bench", "speed benchmark: plain vs HF assisted vs eagle-fsd (and FSD rows)"),
    "mtbench": ("eagle_fsd.eval.mtbench", "answer MT-Bench questions (FastChat answer jsonl)"),
    "speed": ("eagle_fsd.eval.speed", "speed report of an answer jsonl (tokens/s, speedup, tau, acceptance)"),
    "sweep": ("eagle_fsd.eval.sweep", "quality vs speed over FSD thresholds (HumanEval / GSM8K)"),
    "chat": ("eagle_fsd.chat", "interactive chat with live speed statistics"),
    "train-head": ("eagle_fsd.train", "train an EAGLE-1/2 head for a causal LM"),
}
DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime, with a docstring and two examples."


def run_main(argv=None) -> int:
    import time

    from transformers import TextStreamer

    from eagle_fsd.eval.mtbench import PromptFormat, add_fsd_args, add_model_args, finish_model_args, load_model

    p = argparse.ArgumentParser(prog="eagle-fsd run", description=COMMANDS["run"][1])
    add_model_args(p, max_new_flag=("--max-new-tokens", "--max-new-token"), max_new_default=128, baseline_flag=False)
    add_fsd_args(p)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--no-baseline", action="store_true", help="skip the comparison with HF generate")
    p.add_argument("--profile", action="store_true", help="print the time of each phase of the loop")
    args = p.parse_args(argv)
    finish_model_args(p, args)  # bad FSD settings fail before loading models

    model = load_model(args)
    tok = model.tokenizer
    if model.tuning is not None:
        from eagle_fsd.tune import describe

        print(f"cost model ({model.tuning.path}): {describe(model.tuning)}")
    ids = PromptFormat(tok, args.conv_template).encode([{"role": "user", "content": args.prompt}])
    ids = ids.to(model.base_model.device)
    sampling = dict(max_new_tokens=args.max_new_token, temperature=args.temperature, top_p=args.top_p)
    model.generate(ids[:, :8], max_new_tokens=4)  # warm-up
    print(f"\n>>> {args.prompt}\n")
    out = model.generate(ids, streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True),
                         return_dict=True, fsd_threshold=args.fsd_threshold, fsd_divergence=args.fsd_divergence,
                         fsd_mode=args.fsd_mode, profile=args.profile, **sampling)
    speed = out.new_tokens / out.wall_time
    print(f"\neagle-fsd: {out.new_tokens} tokens in {out.wall_time:.2f} s = {speed:.2f} tokens/s, "
          f"tau = {out.tau:.2f} tokens per target forward ({out.verify_steps} verification steps)")
    if out.fell_back:
        print(f"speed guard: {out.plain_steps} of {out.verify_steps} steps decoded plainly (speculation measured "
              "slower than plain decoding)")
    if args.fsd_threshold is not None:
        print(f"fsd {args.fsd_divergence} T={args.fsd_threshold:g}: fuzzy fraction {out.fuzzy_fraction:.2f}")
    if args.profile:
        total = sum(out.phase_seconds.values())
        print("time by phase: " + ", ".join(f"{k} {v:.2f} s ({100 * v / total:.0f} %)"
                                            for k, v in out.phase_seconds.items()) + " (after prefill)")
    if not args.no_baseline:
        print("HF generate of the same prompt (the target alone)...", flush=True)
        hf = dict(do_sample=args.temperature > 0, max_new_tokens=args.max_new_token)
        if args.temperature > 0:
            hf.update(temperature=args.temperature, top_p=args.top_p)
        start = time.perf_counter()
        seq = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), **hf)
        wall = time.perf_counter() - start
        new = seq.shape[1] - ids.shape[1]
        same = "identical output" if torch.equal(seq, out.sequences) else "different output"
        print(f"HF generate: {new} tokens in {wall:.2f} s = {new / wall:.2f} tokens/s")
        print(f"speedup:   {speed / (new / wall):.2f}x ({same})")
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
