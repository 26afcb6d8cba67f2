"""torch.compile (Inductor, weights frozen) against eager with prepacked weights (eagle_fsd.prepack) on the target's
fixed-shape forward: k new tokens over a StaticCache holding ~200 positions, k = 1 and 4 (a plain step and a small
tree's verification), median of 15 calls after warm-up; the compile time is printed too.

    python benchmarks/compile_probe/compile_forward.py smollm2-135m-instruct bf16
"""
import statistics
import sys
import time

import torch
import torch._inductor.config as inductor_config
from transformers import AutoModelForCausalLM, StaticCache

from eagle_fsd.prepack import prepack_linears
from eagle_fsd.presets import resolve_model

torch.set_num_threads(2)
name, dtype = sys.argv[1], {"bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[2]]
inductor_config.freezing = True  # weights become constants Inductor may prepack, as eagle_fsd.prepack does by hand
path = resolve_model(name)


def timed(model, k, calls=15):
    cache = StaticCache(config=model.config, max_cache_len=320)
    ids = torch.randint(100, 5000, (1, 200))
    with torch.inference_mode():
        model(ids, past_key_values=cache, cache_position=torch.arange(200), use_cache=True)
        new = torch.randint(100, 5000, (1, k))
        pos = torch.arange(200, 200 + k)
        start = time.perf_counter()
        model(new, past_key_values=cache, cache_position=pos, use_cache=True)  # compiles here when compiled
        first = time.perf_counter() - start
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            model(new, past_key_values=cache, cache_position=pos, use_cache=True)
            times.append(time.perf_counter() - start)
    return first, statistics.median(times) * 1e3


packed = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
prepack_linears(packed)
compiled = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
compiled.forward = torch.compile(compiled.forward, dynamic=False)
for k in (1, 4):
    _, eager_ms = timed(packed, k)
    first, compiled_ms = timed(compiled, k)
    print(f"{name} {sys.argv[2]} k={k}: eager prepacked {eager_ms:.1f} ms, compiled {compiled_ms:.1f} ms "
          f"(first call incl. compile {first:.0f} s)", flush=True)
