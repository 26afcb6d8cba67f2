"""A/B of the int8 drafter's activation rounding (#23): per row (as the target's layers must) against one scale per
call (what a drafter uses), on the same loaded drafter, switched between interleaved rounds.

    python benchmarks/drafter_rounding_ab.py [--rounds 25]

Times the engine's own draft operations (eagle_fsd.tune.measure.DraftSetup) on the Qwen preset at defaults, after a
160-token plain generation: a tree level of 1 and of 2 nodes, and the catch-up over 3 accepted tokens.
"""
import argparse
import statistics
import time

import torch

from eagle_fsd.model import EaFsdModel
from eagle_fsd.target_quant import RowQuantLinear
from eagle_fsd.tune.measure import DraftSetup
from eagle_fsd.tune.replay import target_hidden

PROMPT = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
          "must-see attractions.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", total_token=4, depth=1, top_k=2,
                                       draft_vocab=37888)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]
    context = model.naive_generate(ids, max_new_tokens=160, return_dict=True).sequences[0]
    setup = DraftSetup(model.drafter, context, target_hidden(model, context), room=40)
    layers = [m for m in model.drafter.module.modules() if isinstance(m, RowQuantLinear)]
    products = {id(m.product): m.product for m in layers + [model.drafter.draft_head.quant]}.values()
    ops = {"level of 1 node": lambda: setup.level(1), "level of 2 nodes": lambda: setup.level(2),
           "catch-up over 3 tokens": setup.extend}
    times = {(per_row, name): [] for per_row in (True, False) for name in ops}
    for _ in range(args.rounds):
        for per_row in (True, False):
            for product in products:
                product.per_row = per_row
            for name, op in ops.items():
                start = time.perf_counter()
                op()
                times[(per_row, name)].append(1000 * (time.perf_counter() - start))
    print(f"{len(products)} int8 products in the drafter, {args.threads} threads, median of {args.rounds} rounds")
    for name in ops:
        row, call = statistics.median(times[(True, name)]), statistics.median(times[(False, name)])
        print(f"{name}: per row {row:.1f} ms, per call {call:.1f} ms, {call / row:.2f}x")


if __name__ == "__main__":
    main()
