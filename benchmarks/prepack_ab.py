"""Prepacked vs plain linear kernels, one process: a HF forward over k new tokens atop a 170-token cache, the two
kernels alternated round by round (eagle_fsd.prepack.unpacked), median of the last 7 of 9 rounds.

    python benchmarks/prepack_ab.py smollm2-135m-instruct bf16
"""
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from eagle_fsd.prepack import prepack_linears, unpacked
from eagle_fsd.presets import resolve_model

torch.set_num_threads(2)
name, dtype = sys.argv[1], {"bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[2]]
model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype).eval()
prepack_linears(model)
sizes = [1, 2, 3, 4, 6, 8, 12, 16]
times = {(k, packed): [] for k in sizes for packed in (False, True)}
with torch.inference_mode():
    cache = DynamicCache()
    model(torch.randint(100, 5000, (1, 170)), past_key_values=cache, use_cache=True)
    for rnd in range(9):
        for k in sizes:
            for packed in (False, True):
                ids = torch.randint(100, 5000, (1, k))
                with unpacked(*([] if packed else [model])):
                    start = time.perf_counter()
                    model(ids, past_key_values=cache, use_cache=True)
                    elapsed = time.perf_counter() - start
                cache.crop(-k)
                if rnd >= 2:
                    times[(k, packed)].append(elapsed * 1e3)
ms = {key: statistics.median(v) for key, v in times.items()}
for k in sizes:
    print(f"k={k:3d} plain {ms[(k, False)]:7.1f} ms  packed {ms[(k, True)]:7.1f} ms  "
          f"gain {ms[(k, False)] / ms[(k, True)]:.2f}x")
