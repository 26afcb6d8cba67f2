"""What a tree verification would cost in llama.cpp: one forward of the Qwen2.5-Coder-1.5B Q4_K_M GGUF over n new
tokens on a 200-token cache, n = 1..8, 16, against n = 1 (best of 7 after a warm-up), 2 threads; and the same for the
0.5B GGUF (a drafter's level). The n tokens are a chain; a tree of n nodes costs the same matmuls (llama.cpp expresses
the tree mask through per-token sequence ids).

    python benchmarks/llama_cpp_probes/verify_cost.py   # needs llama-cpp-python and `eagle-fsd models gguf ...`
"""
import json
import sys
import time

from eagle_fsd.eval.llama_cpp_peer import open_gguf
from eagle_fsd.presets import fetch_gguf

CONTEXT, SIZES, REPEATS = 200, (1, 2, 3, 4, 5, 6, 8, 16), 7


def forward_ms(llm, n: int) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        llm.n_tokens = CONTEXT  # drop the previous forward's tokens from the cache (eval removes cells past n_tokens)
        start = time.perf_counter()
        llm.eval([100 + i for i in range(n)])
        best = min(best, time.perf_counter() - start)
    return best * 1e3


results = {}
for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"):
    llm = open_gguf(fetch_gguf(name), 2, 512)
    llm.eval([1000 + (i % 500) for i in range(CONTEXT)])
    forward_ms(llm, 1)
    ms = {n: round(forward_ms(llm, n), 2) for n in SIZES}
    results[name] = {"ms": ms, "ratio": {n: round(ms[n] / ms[1], 2) for n in SIZES}}
    print(name, results[name], flush=True)
json.dump(results, sys.stdout if len(sys.argv) < 2 else open(sys.argv[1], "w"), indent=1)
