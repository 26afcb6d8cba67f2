"""The `eagle-fsd` command: run (the main job), models, bench, mtbench, speed, sweep, calibrate, chat, train-head."""
from __future__ import annotations

import argparse
import importlib
import sys

import torch

from eagle_fsd.dtypes import dtype_name

COMMANDS = {  # name -> (module with a main(argv) -> int, one-line help)
    "run": ("eagle_fsd.cli", "generate with speculative decoding, then plain decoding; print speed, tau, speedup"),
    "models": ("eagle_fsd.presets:main_models", "list / fetch the offline model presets"),
    "tune": ("eagle_fsd.tune_cli", "measure the speculation cost model on this machine; print the best tree shapes"),
    "bench": ("eagle_fsd.eval.bench", "speed benchmark: plain vs HF assisted vs eagle-fsd (and FSD rows)"),
    "mtbench": ("eagle_fsd.eval.mtbench", "answer MT-Bench questions (FastChat answer jsonl)"),
    "speed": ("eagle_fsd.eval.speed", "speed report of an answer jsonl (tokens/s, speedup, tau, acceptance)"),
    "sweep": ("eagle_fsd.eval.sweep", "the FSD frontier: accuracy and speed per divergence / rule / T, paired CIs"),
    "calibrate": ("eagle_fsd.eval.calibrate", "the largest FSD threshold within an accuracy (or NLL) budget"),
    "chat": ("eagle_fsd.chat", "interactive chat with live speed statistics"),
    "train-head": ("eagle_fsd.train", "train an EAGLE-1/2 or EAGLE-3 head for a causal LM"),
}
DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime, with a docstring and two examples."


def parse_run_args(argv):
    """(Settings, the run's own flags: prompt, no_baseline, profile)."""
    from eagle_fsd.settings import add_fsd_args, add_model_args, parse_settings

    p = argparse.ArgumentParser(prog="eagle-fsd run", description=COMMANDS["run"][1])
    add_model_args(p, max_new_flag=("--max-new-tokens", "--max-new-token"), max_new_default=128, baseline_flag=False)
    add_fsd_args(p)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--no-baseline", action="store_true", help="skip the comparison with HF generate")
    p.add_argument("--profile", action="store_true", help="print the time of each phase of the loop")
    args = p.parse_args(argv)
    return parse_settings(p, args), args  # bad FSD settings fail here, before loading models


def run_main(argv=None) -> int:
    from transformers import TextStreamer

    from eagle_fsd.prompts import PromptFormat
    from eagle_fsd.model import exactness, load_model

    settings, args = parse_run_args(argv)
    model = load_model(settings)
    tok = model.tokenizer
    plan = model.plan
    if settings.fsd.threshold is None and settings.generation.temperature == 0:
        print(f"exactness: {exactness(plan.target.dtype, plan.target.weights.quantized_rows)}")
    if model.tuning is not None:
        from eagle_fsd.tune import describe

        print(f"cost model ({model.tuning.path}): {describe(model.tuning)}")
    print(f"run plan: {plan.summary()} (--target-quant, --prepack, --draft-quant off: as loaded)")
    ids = PromptFormat(tok, settings.model.conv_template).encode([{"role": "user", "content": args.prompt}])
    ids = ids.to(model.base_model.device)
    model.generate(ids[:, :8], max_new_tokens=4)  # warm-up
    print(f"\n>>> {args.prompt}\n")
    out = model.generate(ids, streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True),
                         return_dict=True, fsd=settings.fsd, profile=args.profile,
                         **settings.generation.sampling_kwargs())
    speed = out.new_tokens / out.wall_time
    print_run(out, settings.fsd, args.profile)
    if not args.no_baseline:
        compare_with_hf_generate(model, ids, settings.generation, out.sequences, speed,
                                 fuzzy=settings.fsd.threshold is not None)
    return 0


def print_run(out, fsd, profile: bool) -> None:
    """Speed, tau (tokens per target forward), the speed guard's plain steps, FSD's share, time by phase."""
    print(f"\neagle-fsd: {out.new_tokens} tokens in {out.wall_time:.2f} s = {out.new_tokens / out.wall_time:.2f} "
          f"tokens/s, tau = {out.tau:.2f} tokens per target forward ({out.verify_steps} verification steps)")
    if out.fell_back:
        print(f"speed guard: {out.plain_steps} of {out.verify_steps} steps decoded plainly (speculation measured "
              "slower than plain decoding)")
    if fsd.threshold is not None:
        print(f"fsd {fsd.divergence} T={fsd.threshold:g}: fuzzy fraction {out.fuzzy_fraction:.2f}")
    if profile:
        total = sum(out.phase_seconds.values())
        print("time by phase: " + ", ".join(f"{k} {v:.2f} s ({100 * v / total:.0f} %)"
                                            for k, v in out.phase_seconds.items()) + " (after prefill)")
        print("draft trees (speculative steps): " + (", ".join(f"{k} {v}" for k, v in out.tree_steps.items())
                                                     or "none") + f"; re-chosen {out.tree_switches} times")


def compare_with_hf_generate(model, ids, generation, sequences, speed: float, fuzzy: bool = False) -> None:
    """HF generate of the same prompt with the target alone (plain `F.linear` kernels, as users run it; an int8
    target's float weights, loaded afresh): its speed, our speedup, and whether outputs match."""
    import time

    from eagle_fsd.loading import as_hf_runs_it

    print("HF generate of the same prompt (the target alone)...", flush=True)
    target = as_hf_runs_it(model.base_model, model.plan.target)
    hf = dict(do_sample=generation.temperature > 0, max_new_tokens=generation.max_new_tokens)
    if generation.temperature > 0:
        hf.update(temperature=generation.temperature, top_p=generation.top_p)
    target.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), do_sample=False,
                    max_new_tokens=4)  # warm-up
    start = time.perf_counter()
    seq = target.generate(ids, attention_mask=torch.ones_like(ids), **hf)
    wall = time.perf_counter() - start
    new = seq.shape[1] - ids.shape[1]
    print(f"HF generate: {new} tokens in {wall:.2f} s = {new / wall:.2f} tokens/s")
    agreement = output_agreement(seq, sequences, ids.shape[1], model.base_model.dtype, hf["do_sample"], fuzzy,
                                 model.plan.target.weights.quantized_rows)
    print(f"speedup:   {speed / (new / wall):.2f}x ({agreement})")


def output_agreement(reference: torch.Tensor, sequences: torch.Tensor, prompt_len: int, dtype: torch.dtype,
                     sampled: bool, fuzzy: bool = False, quantized: bool = False) -> str:
    """Whether two outputs agree, and if not, from which new token and why that can happen."""
    n = min(reference.shape[1], sequences.shape[1])
    differ = (reference[0, :n] != sequences[0, :n]).nonzero()
    if not differ.numel() and reference.shape[1] == sequences.shape[1]:
        return "identical output"
    first = (int(differ[0, 0]) if differ.numel() else n) - prompt_len + 1
    if fuzzy:
        why = "FSD accepts draft tokens whose divergence is under the threshold, by design"
    elif sampled:
        why = "both sampled, so they differ by chance"
    elif quantized:
        why = ("the quantized target is not HF's float model: eagle-fsd reproduces plain greedy decoding of the "
               "quantized model (--target-quant off compares the float weights)")
    elif dtype == torch.float32:
        why = "unexpected for greedy decoding in fp32: please report it with this command"
    else:
        why = (f"in {dtype_name(dtype)} a forward over several tokens rounds differently from a "
               "one-token forward, which can flip a near-tied greedy choice; --dtype fp32 gives the target's exact "
               "greedy output")
    return f"output differs from new token {first} on: {why}"


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
