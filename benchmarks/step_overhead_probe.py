"""How much of a target verification and a drafter forward is weight products, and how much is everything around
them (norms, rotary, attention, cache, Python): the Qwen preset at its defaults, a ~300-token cache, 2 threads.

    python benchmarks/step_overhead_probe.py [TOP]

Prints, per forward kind, the median wall time, the time inside the quantized products (each call timed), and the
ATen operator count of one forward (torch.profiler); with TOP, its TOP costliest operators.
"""
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from eagle_fsd import target_quant
from eagle_fsd.cache import TreeCache
from eagle_fsd.hf import causal_mask, decoder_outputs, prefix_tree_mask
from eagle_fsd.model import EaFsdModel

PROMPT = ("Write a Python function that parses a CSV file of transactions (date, amount, category), groups them by "
          "month and category, and prints a table of totals. Explain each step, handle malformed rows, and add "
          "type hints and a docstring. ") * 3
ROUNDS = 15
TABLE = int(sys.argv[1]) if len(sys.argv) > 1 else 0  # print the top TABLE operators of each forward


class TimedProduct:
    def __init__(self, product, clock):
        self.product, self.clock = product, clock
        self.activation_bits, self.per_row = product.activation_bits, product.per_row
        self.out_features, self.in_features = product.out_features, product.in_features

    def __call__(self, x):
        start = time.perf_counter()
        y = self.product(x)
        self.clock[0] += time.perf_counter() - start
        return y


def time_products(module, clock):
    for layer in module.modules():
        if isinstance(layer, target_quant.RowQuantLinear):
            holder = layer.product if isinstance(layer.product, target_quant.SharedInputProduct) else layer
            if not isinstance(holder.product, TimedProduct):
                holder.product = TimedProduct(holder.product, clock)


def measure(name, run, undo, clock):
    run(), undo()
    walls, products = [], []
    for _ in range(ROUNDS):
        clock[0] = 0.0
        start = time.perf_counter()
        run()
        walls.append(time.perf_counter() - start)
        products.append(clock[0])
        undo()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    undo()
    events = prof.key_averages()
    ops = sum(event.count for event in events)
    wall, product = statistics.median(walls) * 1e3, statistics.median(products) * 1e3
    print(f"{name:34s} wall {wall:6.1f} ms  products {product:6.1f} ms  rest {wall - product:5.1f} ms  "
          f"ops {ops}")
    if TABLE:
        print(events.table(sort_by="self_cpu_time_total", row_limit=TABLE))


def main():
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", total_token=5, depth=1, top_k=4,
                                       draft_vocab=37888, tune_progress=False)
    target, drafter = model.base_model, model.drafter
    print(f"target: {target_quant.int4_share(target):.0%} of weights int4 | drafter: "
          f"{target_quant.int4_share(drafter.module):.0%}")
    clock = [0.0]
    time_products(target, clock)
    time_products(drafter.module, clock)
    ids = model.tokenizer(PROMPT, return_tensors="pt")["input_ids"][0]
    n = ids.numel()
    print("prompt tokens:", n)
    cache = TreeCache.for_model(target, n + 64, model.plan.target)
    decoder_outputs(target, ids, cache, causal_mask(0, n, ids.device), torch.arange(n), model.plan.target)
    head = target.get_output_embeddings()

    def target_forward(k):
        tokens = ids[:k]
        tree = torch.ones(k, k, dtype=torch.bool).tril()
        hidden, _ = decoder_outputs(target, tokens, cache, prefix_tree_mask(n, tree), n + torch.arange(k),
                                    model.plan.target)
        head(hidden)

    with model._drafting_for(model.shape):
        drafter.reset(n + 64)
        drafter.prefill(ids[:-3], ids[-3])
        length = drafter.length
        for k in (1, 5):
            measure(f"target verify, {k} token(s) + lm_head", lambda k=k: target_forward(k),
                    lambda: cache.crop(n), clock)
        measure("drafter catch-up, 3 tokens", lambda: drafter.extend(ids[-3:]), lambda: drafter.rewind(length), clock)
        for k in (1, 2, 4):
            mask = torch.eye(k, dtype=torch.bool)
            measure(f"drafter level, {k} node(s)", lambda k=k, mask=mask: drafter.forward_level(ids[:k], None, 0, mask),
                    drafter.rollback, clock)


if __name__ == "__main__":
    main()
