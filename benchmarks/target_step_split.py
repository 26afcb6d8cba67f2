"""Where a plain decoding step of the Qwen preset goes: time of every quantized product call (int4 / int8, by shape)
against the whole step, 33 new tokens after a 40-token prompt, 2 threads. The step runs layer by layer from Python
(`fused_decoder.layer_by_layer`), so that every product call is timed; the one-call C++ forward the engine runs is a
little faster (BENCHMARKS.md, "A few-row forward in one C++ call").

    python benchmarks/target_step_split.py [int4|int8]
"""
import collections
import sys
import time

import torch

from eagle_fsd import target_quant
from eagle_fsd.fused_decoder import layer_by_layer
from eagle_fsd.model import EaFsdModel

PROMPT = "Write a Python function that checks whether a number is prime."


class TimedProduct:
    """A product that adds its calls and seconds to `calls[(kind, out, in)]`."""

    def __init__(self, product, calls):
        self.product, self.calls = product, calls
        self.key = (type(product).__name__, product.out_features, product.in_features)
        self.activation_bits, self.per_row = product.activation_bits, product.per_row
        self.out_features, self.in_features = product.out_features, product.in_features

    def __call__(self, x):
        start = time.perf_counter()
        y = self.product(x)
        entry = self.calls[self.key]
        entry[0], entry[1] = entry[0] + 1, entry[1] + time.perf_counter() - start
        return y


def main(quant: str = "int4", new_tokens: int = 33):
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", total_token=5, depth=1, top_k=4,
                                       draft_vocab=37888, target_quant=quant, tune_progress=False)
    print(f"target: {target_quant.int4_share(model.base_model):.0%} of its weights int4, the rest int8")
    calls = collections.defaultdict(lambda: [0, 0.0])  # (kind, out, in) -> [calls, seconds]
    for layer in model.base_model.modules():
        if isinstance(layer, target_quant.RowQuantLinear):
            holder = layer.product if isinstance(layer.product, target_quant.SharedInputProduct) else layer
            if not isinstance(holder.product, TimedProduct):
                holder.product = TimedProduct(holder.product, calls)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                              return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    with layer_by_layer():
        model.naive_generate(ids, max_new_tokens=4)
        calls.clear()
        start = time.perf_counter()
        model.naive_generate(ids, max_new_tokens=new_tokens)
    step_ms = (time.perf_counter() - start) / new_tokens * 1e3
    products_ms = sum(seconds for _, seconds in calls.values()) / new_tokens * 1e3
    print(f"{step_ms:.1f} ms a token: products {products_ms:.1f}, everything else {step_ms - products_ms:.1f}")
    for (name, out_f, in_f), (n, seconds) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name} {out_f} x {in_f}: {n} calls, {seconds / n * 1e3:.3f} ms a call, "
              f"{seconds / new_tokens * 1e3:.1f} ms a token")


if __name__ == "__main__":
    main(*sys.argv[1:2])
