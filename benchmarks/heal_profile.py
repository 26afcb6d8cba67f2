"""A cost profile corrupted to say speculation cannot pay (every t_verify(n) x FACTOR) heals within the run.

In one process, for one preset, same prompts, each generation timed against plain decoding of the same prompt:
  clean     the cached profile as tuned (checked at load, as every load does);
  healed    the cached file corrupted, then loaded as usual: the load-time check re-times it;
  guarded   the corrupted profile used without the load-time check (a machine busy at load): only the speed guard,
            which takes t_plain from the plain steps it runs, can bring speculation back within the generation.
The cached file is restored at the end. Run on a quiet machine:

    python benchmarks/heal_profile.py --model smollm2-135m-instruct --threads 2
    python benchmarks/heal_profile.py --model qwen2.5-coder-1.5b-instruct --threads 2 --prompts 2
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from eagle_fsd.eval.data import load_questions
from eagle_fsd.loading import drafter_name
from eagle_fsd.model import EaFsdModel
from eagle_fsd.prompts import PromptFormat
from eagle_fsd.tune import autotune, read_profile


def corrupt(path: Path, factor: float) -> None:
    raw = json.loads(path.read_text())
    raw["profile"]["verify_ms"] = {n: t * factor for n, t in raw["profile"]["verify_ms"].items()}
    path.write_text(json.dumps(raw, indent=1))


def timed(model, prompts, new_tokens: int) -> dict:
    """Speculative and plain decoding of every prompt, interleaved: tokens/s of each and the speculative run's
    plain steps."""
    spec_s = plain_s = spec_tokens = plain_tokens = plain_steps = steps = 0
    for ids in prompts:
        out = model.generate(ids, max_new_tokens=new_tokens, eos_token_id=[], return_dict=True)
        ref = model.naive_generate(ids, max_new_tokens=new_tokens, eos_token_id=[], return_dict=True)
        assert out.new_tokens == ref.new_tokens == new_tokens
        spec_s, plain_s = spec_s + out.wall_time, plain_s + ref.wall_time
        spec_tokens, plain_tokens = spec_tokens + out.new_tokens, plain_tokens + ref.new_tokens
        plain_steps, steps = plain_steps + out.plain_steps, steps + out.verify_steps
    return {"speedup": round((spec_tokens / spec_s) / (plain_tokens / plain_s), 3),
            "spec_tok_s": round(spec_tokens / spec_s, 2), "plain_tok_s": round(plain_tokens / plain_s, 2),
            "plain_steps": f"{plain_steps}/{steps}"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=3, help="the first N MT-Bench first turns")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = EaFsdModel.from_pretrained(args.model)
    fmt = PromptFormat(model.tokenizer, None)
    prompts = [fmt.encode([{"role": "user", "content": q["turns"][0]}]) for q in load_questions()[: args.prompts]]
    model.generate(prompts[0][:, :8], max_new_tokens=4)  # warm-up
    path = Path(model.tuning.path)
    backup = path.with_suffix(".clean")
    shutil.copy(path, backup)
    rows = {}
    try:
        rows["clean"] = {"shape": model.tuning.shape, "speculate": model.tuning.speculate, **timed(model, prompts, args.new_tokens)}
        corrupt(path, args.factor)
        bad = read_profile(path)
        healed_model = EaFsdModel.from_pretrained(args.model)  # loads as usual: the check re-times the profile
        rows["healed at load"] = {"shape": healed_model.tuning.shape, "speculate": healed_model.tuning.speculate,
                                  **timed(healed_model, prompts, args.new_tokens)}
        shutil.copy(backup, path)
        corrupt(path, args.factor)
        # the corrupted profile without the load-time check: only the speed guard can heal it
        name = drafter_name(args.model, None, None)
        tuning = autotune(healed_model, args.model, name, fixed={}, check=False)
        guarded = EaFsdModel(healed_model.base_model, healed_model.tokenizer, healed_model.drafter,
                             shape=tuning.tree, tuning=tuning)
        rows["guard only"] = {"shape": tuning.shape, "speculate": tuning.speculate,
                              **timed(guarded, prompts, args.new_tokens)}
        rows["corrupted profile"] = {"predicted": round(tuning.predicted_speedup, 3),
                                     "verify_ms[1]": round(bad.verify_ms[1], 1)}
    finally:
        shutil.copy(backup, path)
        backup.unlink()
    for name, row in rows.items():
        print(f"{name:>18}: {row}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "threads": args.threads,
                                               "new_tokens": args.new_tokens, "prompts": args.prompts,
                                               "factor": args.factor, "date": time.strftime("%Y-%m-%d %H:%M"),
                                               "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
