"""The speed guard against fixed trees and plain decoding, and what verification costs per tree size in the engine.

The Qwen preset at its defaults (the tuned shape and guard), the first 4 MT-Bench first turns, 128 new tokens,
2 threads, twice over. Per arm: tokens/s over the 4 questions, the median verify time per tree size (ms) and how
many steps ran at that size, and for the guarded arm its plain steps. Arms run one after another within a round:
compare them within a round (this VM's speed drifts between rounds).

    python benchmarks/guard_probe.py
"""
import statistics
import time
from collections import defaultdict

import torch

from eagle_fsd.eval.bench import prompts
from eagle_fsd.model import EaFsdModel
from eagle_fsd.tree.shape import TreeShape


def main():
    torch.set_num_threads(2)
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", tune_progress=False)
    n, d, k, v = model.tuning.shape
    print("tuned", model.shape, f"predicted {model.tuning.predicted_speedup:.2f}x",
          {size: round(ms, 1) for size, ms in model.tuning.verify_ms.items() if size <= 6})
    verify_seconds = defaultdict(list)
    verify = model._verify

    def timed_verify(tree, cache, layers=None):
        start = time.perf_counter()
        out = verify(tree, cache, layers)
        verify_seconds[tree.tokens.numel()].append(time.perf_counter() - start)
        return out

    model._verify = timed_verify  # timing only: the same call
    questions = prompts(model.tokenizer, 4)
    arms = {"guarded (defaults)": lambda ids: model.generate(ids, max_new_tokens=128, return_dict=True),
            f"fixed {model.shape.eagle()}": lambda ids: model.generate(ids, max_new_tokens=128, return_dict=True,
                                                                     shape=TreeShape(n, d, k, v)),
            "fixed (3, 1, 1)": lambda ids: model.generate(ids, max_new_tokens=128, return_dict=True,
                                                          shape=TreeShape(3, 1, 1, v)),
            "plain": lambda ids: model.naive_generate(ids, max_new_tokens=128, return_dict=True)}
    for round_ in range(2):
        for name, run in arms.items():
            verify_seconds.clear()
            tokens, seconds, plain_steps, steps = 0, 0.0, 0, 0
            for ids in questions:
                start = time.perf_counter()
                out = run(ids)
                seconds += time.perf_counter() - start
                tokens, plain_steps, steps = tokens + out.new_tokens, plain_steps + out.plain_steps, steps + out.verify_steps
            sizes = {size: (len(t), round(1000 * statistics.median(t), 1)) for size, t in sorted(verify_seconds.items())}
            print(f"round {round_ + 1} {name:22s} {tokens / seconds:6.2f} tok/s  tau {tokens / steps:.2f}  "
                  f"plain steps {plain_steps}/{steps}  verify (steps, median ms) by size {sizes}", flush=True)


if __name__ == "__main__":
    main()
