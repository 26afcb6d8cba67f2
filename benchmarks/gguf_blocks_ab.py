"""The quantized target on its GGUF's own Q4_K / Q6_K blocks (eagle_fsd.gguf_blocks) against the same target rounded
again (int4 x int8 where the GGUF is 4-bit, int8 x int8 elsewhere): the Qwen preset, both loaded in one process, a
148-token cache each, a forward of 1-8 tokens on top of it plus the lm_head, 2 threads, arms interleaved, median ms
of 15 rounds. Also the bytes of weight each arm's plain step reads.

    python benchmarks/gguf_blocks_ab.py
"""
import statistics
import time

import torch

from eagle_fsd import presets
from eagle_fsd.cache import TreeCache
from eagle_fsd.hf import causal_mask, decoder_outputs, prefix_tree_mask
from eagle_fsd.loading import load_target, model_run
from eagle_fsd.plan import WeightFormat
from eagle_fsd.product_store import format_cached
from eagle_fsd.target_quant import RowQuantLinear, cpu_activation_bits, gguf_share, own_product

MODEL = "qwen2.5-coder-1.5b-instruct"
PROMPT = ("Write a Python function that parses a CSV file of transactions (date, amount, category), groups them by "
          "month and category, and prints a table of totals. Explain each step, handle malformed rows, and add "
          "type hints and a docstring. ") * 3
ROUNDS = 15


def step_bytes(model) -> int:
    """Bytes of the products a one-token step reads (a shared product once)."""
    products = {id(own_product(m.product)): own_product(m.product) for m in model.modules()
                if isinstance(m, RowQuantLinear)}.values()
    return sum(t.numel() * t.element_size() for p in products for t in p.state().values())


def main():
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    path, gguf = presets.resolve_model(MODEL), presets.gguf_path(MODEL)
    if not gguf.is_file():
        raise SystemExit(f"no {gguf}: run `eagle-fsd models gguf {MODEL}` first")
    arms = {}
    for name, fmt in (("GGUF blocks", WeightFormat("rows", cpu_activation_bits(), four_bit=True, gguf=str(gguf))),
                      ("rounded again", WeightFormat("rows", cpu_activation_bits(), four_bit=True))):
        target, tokenizer = load_target(path, "auto", None, {})
        format_cached(target, fmt)
        run = model_run(target, fmt, "auto", exact=True, decoder=True)
        print(f"{name}: {run.label()}; GGUF share {gguf_share(target):.0%}; a plain step reads "
              f"{step_bytes(target) / 1e6:.0f} MB", flush=True)
        arms[name] = (target, run)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"][0]
    n = ids.numel()
    caches = {}
    for name, (target, run) in arms.items():
        caches[name] = TreeCache.for_model(target, n + 64, run)
        decoder_outputs(target, ids, caches[name], causal_mask(0, n, ids.device), torch.arange(n), run)
    for k in (1, 2, 3, 5, 8):
        tree = torch.ones(k, k, dtype=torch.bool).tril()
        times, tokens = {name: [] for name in arms}, {}
        for i in range(ROUNDS + 1):
            for name in (list(arms) if i % 2 else list(arms)[::-1]):
                target, run = arms[name]
                start = time.perf_counter()
                hidden, _ = decoder_outputs(target, ids[:k], caches[name], prefix_tree_mask(n, tree),
                                            n + torch.arange(k), run)
                logits = target.get_output_embeddings()(hidden)
                elapsed = time.perf_counter() - start
                caches[name].crop(n)
                if i:
                    times[name].append(elapsed)
                tokens[name] = logits.argmax(-1)
        gguf_ms, again_ms = (statistics.median(times[name]) * 1e3 for name in arms)
        same = torch.equal(*tokens.values())
        print(f"{k} token(s) + lm_head: GGUF blocks {gguf_ms:6.1f} ms  rounded again {again_ms:6.1f} ms  "
              f"ratio {again_ms / gguf_ms:.2f}x  same greedy tokens {same}", flush=True)


if __name__ == "__main__":
    main()
