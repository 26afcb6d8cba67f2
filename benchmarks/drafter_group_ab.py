"""A/B of the LM drafter's 4-bit groups: 128 inputs per scale (4.25 bits a weight, the loader's DRAFTER_INT4_GROUP)
against 32 (5 bits, the target's), one target, two drafters, switched question by question.

    python benchmarks/drafter_group_ab.py [--questions 10] [--max-new-tokens 128] [--tree 3,1,1,37888]

First the kernel on the drafter's shapes, groups of 128 against 32 (kernel_times). Then the Qwen preset at its
defaults, MT-Bench q81-90 as `eagle-fsd bench` feeds them, 2 threads, a fixed tree (no speed guard), arms in turn per
question (plain decoding, then each drafter). Prints per arm tokens/s, tokens per step and the speedup over plain
decoding of the same run; every arm's tokens must equal plain decoding's.
"""
import argparse
import random
import statistics
import time

import torch

from eagle_fsd.drafting import LMDrafter
from eagle_fsd.eval.bench import prompts
from eagle_fsd.kernels import int4_rows as k4
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


def kernel_times(shapes=((1152, 896), (9728, 896), (896, 4864), (37888, 896)), reps: int = 40) -> None:
    """int4_rows on the 0.5B drafter's shapes (q | k | v, gate | up, down, the draft head), groups of 128 against 32:
    copies of each packed weight beyond the caches, the two called in random order, medians."""
    for n, k in shapes:
        weight = torch.randn(n, k)
        packs = {}
        for group in (32, 128):
            packed = k4.pack_int4(*k4.quantize_int4(weight, group))
            packs[group] = [packed.clone() for _ in range(max(2, int(80e6 // packed.numel())))]
        for rows in (1, 2):
            x, times = torch.randn(rows, k), {32: [], 128: []}
            for rep in range(reps):
                for group in random.sample([32, 128], 2):
                    packed = packs[group][rep % len(packs[group])]
                    start = time.perf_counter()
                    k4.int4_rows_linear(x, packed, n)
                    times[group].append(time.perf_counter() - start)
            a, b = statistics.median(times[32]), statistics.median(times[128])
            sizes = [packs[group][0].numel() / 1e6 for group in (32, 128)]
            print(f"kernel {n}x{k}, {rows} row(s): groups of 32 {1000 * a:.3f} ms ({sizes[0]:.2f} MB), "
                  f"of 128 {1000 * b:.3f} ms ({sizes[1]:.2f} MB), {b / a:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", default="3,1,1,37888")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tree = TreeShape(*map(int, args.tree.split(",")))
    kernel_times()
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
