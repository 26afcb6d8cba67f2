"""A/B of the LM drafter's 4-bit groups: 128 inputs per scale (4.25 bits a weight, the loader's DRAFTER_INT4_GROUP)
against 32 (5 bits, the target's), one target, two drafters, switched question by question.

    python benchmarks/drafter_group_ab.py [--questions 10] [--max-new-tokens 128] [--tree 3,1,1,37888]

The Qwen preset at its defaults, MT-Bench q81-90 as `eagle-fsd bench` feeds them, 2 threads, a fixed tree (no speed
guard), arms in turn per question (plain decoding, then each drafter). Prints per arm tokens/s, tokens per step and
the speedup over plain decoding of the same run; every arm's tokens must equal plain decoding's.
"""
import argparse
import time

import torch

from eagle_fsd.drafting import LMDrafter
from eagle_fsd.eval.bench import prompts
from eagle_fsd.loading import DRAFTER_INT4_GROUP
from eagle_fsd.model import EaFsdModel
from eagle_fsd.presets import default_drafter, resolve_model
from eagle_fsd.product_store import format_cached
from eagle_fsd.tree.shape import TreeShape


def drafter_with_group(model: EaFsdModel, name: str, group: int) -> LMDrafter:
    """A second copy of the model's LM drafter, its layers rounded to 4 bits in groups of `group` inputs."""
    drafter = LMDrafter.load(resolve_model(default_drafter(name)), model.base_model, model.tokenizer)
    fmt = model.plan.drafter.weights
    format_cached(drafter.module, type(fmt)(**{**fmt.__dict__, "int4_group": group}))
    drafter.run = model.drafter.run
    drafter.set_draft_vocab(model.drafter.draft_vocab)
    return drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", default="3,1,1,37888")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tree = TreeShape(*map(int, args.tree.split(",")))
    name = "qwen2.5-coder-1.5b-instruct"
    model = EaFsdModel.from_pretrained(name, total_token=tree.total_token, depth=tree.depth,
                                       top_k=tree.branching, draft_vocab=tree.draft_vocab)
    drafters = {f"group {DRAFTER_INT4_GROUP}": model.drafter, "group 32": drafter_with_group(model, name, 32)}
    print(model.plan.summary())
    ids_list = prompts(model.tokenizer, args.questions)
    model.generate(ids_list[0][:, :32], max_new_tokens=8, shape=tree)
    totals = {name: [0.0, 0, 0] for name in ("plain", *drafters)}  # seconds, tokens, steps
    for ids in ids_list:
        start = time.perf_counter()
        plain = model.naive_generate(ids, max_new_tokens=args.max_new_tokens, return_dict=True)
        totals["plain"][0] += time.perf_counter() - start
        totals["plain"][1] += plain.new_tokens
        totals["plain"][2] += plain.verify_steps
        for name, drafter in drafters.items():
            model.drafter = drafter
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, return_dict=True, shape=tree)
            totals[name][0] += time.perf_counter() - start
            assert torch.equal(out.sequences, plain.sequences), f"{name}: tokens differ from plain decoding"
            totals[name][1] += out.new_tokens
            totals[name][2] += out.verify_steps
    plain_rate = totals["plain"][1] / totals["plain"][0]
    for name, (seconds, tokens, steps) in totals.items():
        rate = tokens / seconds
        print(f"{name:10s} {rate:6.2f} tokens/s, {tokens / steps:.2f} tokens a step, {rate / plain_rate:.3f}x plain")


if __name__ == "__main__":
    main()
