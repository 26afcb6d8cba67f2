"""A decoder forward as one C++ call (eagle_fsd.fused_decoder.rows_forward) against the same forward layer by layer
from Python (`layer_by_layer`), in one process, arms interleaved: the Qwen preset at its defaults, a 148-token cache,
2 threads, median ms of 15 rounds per forward kind; and whether both give the same bits.

    python benchmarks/one_call_ab.py
"""
import statistics
import time

import torch

from eagle_fsd import target_quant
from eagle_fsd.cache import TreeCache
from eagle_fsd.fused_decoder import layer_by_layer
from eagle_fsd.hf import causal_mask, decoder_outputs, prefix_tree_mask
from eagle_fsd.model import EaFsdModel

PROMPT = ("Write a Python function that parses a CSV file of transactions (date, amount, category), groups them by "
          "month and category, and prints a table of totals. Explain each step, handle malformed rows, and add "
          "type hints and a docstring. ") * 3
ROUNDS = 15


def ab(name, run, undo):
    """(median ms one call, median ms layer by layer), arms alternating, each first in turn; asserts equal outputs."""
    times = {True: [], False: []}
    outputs = {}
    for i in range(ROUNDS + 1):
        for one_call in ((True, False) if i % 2 else (False, True)):
            start = time.perf_counter()
            if one_call:
                out = run()
            else:
                with layer_by_layer():
                    out = run()
            elapsed = time.perf_counter() - start
            undo()
            if i:
                times[one_call].append(elapsed)
            outputs[one_call] = out
    same = torch.equal(outputs[True], outputs[False])
    one, many = (statistics.median(times[k]) * 1e3 for k in (True, False))
    print(f"{name:30s} one call {one:6.1f} ms  layer by layer {many:6.1f} ms  ratio {many / one:.2f}x  "
          f"same bits {same}", flush=True)


def main():
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", total_token=5, depth=1, top_k=4,
                                       draft_vocab=37888, tune_progress=False)
    target, drafter = model.base_model, model.drafter
    print(f"target: {target_quant.int4_share(target):.0%} of weights int4 | drafter: "
          f"{target_quant.int4_share(drafter.module):.0%}")
    ids = model.tokenizer(PROMPT, return_tensors="pt")["input_ids"][0]
    n = ids.numel()
    cache = TreeCache.for_model(target, n + 64, model.plan.target)
    decoder_outputs(target, ids, cache, causal_mask(0, n, ids.device), torch.arange(n), model.plan.target)
    head = target.get_output_embeddings()

    def target_forward(k):
        tree = torch.ones(k, k, dtype=torch.bool).tril()
        hidden, _ = decoder_outputs(target, ids[:k], cache, prefix_tree_mask(n, tree), n + torch.arange(k),
                                    model.plan.target)
        return head(hidden)

    with model._drafting_for(model.shape):
        drafter.reset(n + 64)
        drafter.prefill(ids[:-3], ids[-3])
        length = drafter.length
        for k in (1, 3, 5):
            ab(f"target, {k} token(s) + lm_head", lambda k=k: target_forward(k), lambda: cache.crop(n))
        ab("drafter catch-up, 3 tokens", lambda: drafter.extend(ids[-3:])[0], lambda: drafter.rewind(length))
        for k in (1, 2, 4):
            mask = torch.eye(k, dtype=torch.bool)
            ab(f"drafter level, {k} node(s)",
               lambda k=k, mask=mask: drafter.forward_level(ids[:k], None, 0, mask)[0], drafter.rollback)


if __name__ == "__main__":
    main()
