"""The target's int8 layers (the GGUF's 6-bit tensors and the lm_head) through eagle_fsd.kernels.int8_rows, every
forward on top of the cache one C++ call, against the same layers through FBGEMM, which runs the forward layer by layer
from Python: the Qwen preset at its defaults, a 148-token cache, 2 threads, arms interleaved, median ms of 15 rounds
per forward. The two arms round the int8 weights each its own way, so their outputs are compared by greedy token only.

    python benchmarks/int8_vnni_ab.py
"""
import statistics
import time

import torch

import eagle_fsd.fused_decoder as fused
from eagle_fsd import target_quant
from eagle_fsd.cache import TreeCache
from eagle_fsd.hf import causal_mask, decoder_outputs, prefix_tree_mask
from eagle_fsd.model import EaFsdModel
from eagle_fsd.target_quant import Int8Product, RowQuantLinear, SharedInputProduct

PROMPT = ("Write a Python function that parses a CSV file of transactions (date, amount, category), groups them by "
          "month and category, and prints a table of totals. Explain each step, handle malformed rows, and add "
          "type hints and a docstring. ") * 3
ROUNDS = 15


def int8_twins(model):
    """[(holder of the product, its int8_rows product, an FBGEMM product of the same weight)] for the model's int8
    layers."""
    twins = []
    for module in model.modules():
        if not isinstance(module, RowQuantLinear):
            continue
        holder = module.product if isinstance(module.product, SharedInputProduct) else module
        inner = holder.product
        if isinstance(inner, Int8Product) and inner.rows_kernel and all(t[0] is not holder for t in twins):
            if inner.out_features != module.out_features:
                raise SystemExit("a shared int8 product over several layers: not handled by this probe")
            twins.append((holder, inner, Int8Product(module.weight, inner.bias, inner.activation_bits,
                                                     rows_kernel=False)))
    return twins


def use(twins, ours: bool):
    for holder, own, fbgemm in twins:
        holder.product = own if ours else fbgemm
    fused._plans.clear()
    fused._rows_plans.clear()


def main():
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", total_token=5, depth=1, top_k=4,
                                       draft_vocab=37888, tune_progress=False)
    target = model.base_model
    print(f"target: {target_quant.int4_share(target):.0%} of weights int4, the rest int8")
    twins = int8_twins(target)
    print(f"{len(twins)} int8 products, activation bits {twins[0][1].activation_bits}")
    ids = model.tokenizer(PROMPT, return_tensors="pt")["input_ids"][0]
    n = ids.numel()
    cache = TreeCache.for_model(target, n + 64, model.plan.target)
    decoder_outputs(target, ids, cache, causal_mask(0, n, ids.device), torch.arange(n), model.plan.target)
    head = target.get_output_embeddings()
    for k in (1, 2, 3, 5, 8):
        tree = torch.ones(k, k, dtype=torch.bool).tril()
        times, tokens = {True: [], False: []}, {}
        for i in range(ROUNDS + 1):
            for ours in ((True, False) if i % 2 else (False, True)):
                use(twins, ours)
                fused.rows_plan(target.get_decoder())  # planned once per model in use: not timed
                start = time.perf_counter()
                hidden, _ = decoder_outputs(target, ids[:k], cache, prefix_tree_mask(n, tree), n + torch.arange(k),
                                            model.plan.target)
                logits = head(hidden)
                elapsed = time.perf_counter() - start
                cache.crop(n)
                if i:
                    times[ours].append(elapsed)
                tokens[ours] = logits.argmax(-1)
        one, fb = (statistics.median(times[a]) * 1e3 for a in (True, False))
        print(f"target, {k} token(s) + lm_head: int8_rows {one:6.1f} ms  FBGEMM {fb:6.1f} ms  ratio {fb / one:.2f}x  "
              f"same greedy tokens {torch.equal(tokens[True], tokens[False])}", flush=True)
    use(twins, True)


if __name__ == "__main__":
    main()
