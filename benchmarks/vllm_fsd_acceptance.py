"""FSD inside vLLM: drafts accepted per verification step, and tokens/s, lossless vs FSD thresholds, on the vLLM
tests' pair (SmolLM2-135M-Instruct drafted by a perturbed copy of itself, 3 drafts per step, greedy, fp32).

    .venv-vllm/bin/python benchmarks/vllm_fsd_acceptance.py   # the README's vLLM environment
"""
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests_vllm"))

from pair import generate, perturbed_copy, target_dir  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colours are",
           "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.", "List five prime numbers:",
           "import numpy as np\n"]
ARMS = [("lossless", None), ("kl_qp T=1", {"fsd_threshold": 1.0}), ("kl_qp T=4", {"fsd_threshold": 4.0}),
        ("jsd T=0.3", {"fsd_threshold": 0.3, "fsd_divergence": "jsd"})]


def timed(llm, params):
    start = time.perf_counter()
    tokens, accepted = generate(llm, PROMPTS, params)
    return sum(map(len, tokens)) / (time.perf_counter() - start), accepted, tokens


def main(max_tokens: int = 96):
    target = target_dir()
    common = dict(model=target, dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
                  disable_log_stats=False, enable_prefix_caching=False)
    plain_llm = LLM(**common)
    plain_llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    start = time.perf_counter()
    plain_out = plain_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens))
    plain_tps = sum(len(o.outputs[0].token_ids) for o in plain_out) / (time.perf_counter() - start)
    plain_tokens = [list(o.outputs[0].token_ids) for o in plain_out]
    del plain_llm
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(**common, speculative_config={"method": "draft_model", "model": perturbed_copy(target, tmp),
                                                "num_speculative_tokens": 3})
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        print(f"plain vLLM: {plain_tps:.1f} tok/s ({len(PROMPTS)} prompts, {max_tokens} tokens, batch of all)")
        print("| arm | drafts accepted per step (of 3) | tok/s | vs plain vLLM | outputs equal to plain |")
        print("|---|---|---|---|---|")
        for name, extra in ARMS:
            tps, accepted, tokens = timed(llm, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                              extra_args=extra))
            same = sum(a == b for a, b in zip(tokens, plain_tokens))
            print(f"| {name} | {accepted:.2f} | {tps:.1f} | {tps / plain_tps:.2f}x | {same}/{len(PROMPTS)} |")


if __name__ == "__main__":
    main()
