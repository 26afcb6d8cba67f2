"""How long a preset takes to load, as `eagle-fsd run` loads it (all defaults), and the process's peak RSS.

Run it twice: the first run of a new version (or after deleting ~/.cache/eagle-fsd/products/) rounds and packs the
target's and drafter's weights and keeps them; the second maps them in. The cost profile's check at load (a few
timed steps, re-timed where they disagree) is part of the load, as for a user.

    python benchmarks/load_time.py [--model qwen2.5-coder-1.5b-instruct] [--threads 2]
"""
import argparse
import resource
import time

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    from eagle_fsd.model import EaFsdModel
    from eagle_fsd.target_quant import int4_share

    imported = time.perf_counter()
    model = EaFsdModel.from_pretrained(args.model)
    loaded = time.perf_counter()
    ids = model.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=16)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    print(f"{args.model}: import {imported - start:.1f} s, load {loaded - imported:.1f} s, peak RSS {peak_gb:.2f} GB "
          f"(target {int4_share(model.base_model):.0%} int4, tree {model.shape})")
    print("16 new tokens:", out[0, ids.shape[1]:].tolist())


if __name__ == "__main__":
    main()
