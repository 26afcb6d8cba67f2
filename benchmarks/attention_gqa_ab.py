"""A/B of the engine's SDPA on a CPU (#23): grouped key/value heads read in place (eagle_fsd.attention.sdpa) against
transformers' path, which copies each key/value head once per query head in masked forwards of several queries.
Same process, same loaded models, the two switched question by question.

    python benchmarks/attention_gqa_ab.py [--questions 6] [--max-new-tokens 128] [--threads 2]

Per question and path: plain decoding and lossless speculation (the Qwen preset at defaults) in tok/s, and whether
the outputs agree; then t_verify(n), a target forward over n new tokens atop the last context, median of 9.
"""
import argparse
import statistics
import time

import torch

from eagle_fsd import attention
from eagle_fsd.cache import TreeCache
from eagle_fsd.eval.bench import prompts
from eagle_fsd.hf import causal_mask, decoder_forward
from eagle_fsd.model import EaFsdModel

PATHS = {"in place": True, "copied": False}


def verify_ms(model, context: torch.Tensor, n: int, rounds: int = 9) -> float:
    target = model.base_model
    cache = TreeCache.for_model(target, context.numel() + n, model.plan.target)
    decoder_forward(target, context, cache, causal_mask(0, context.numel(), context.device),
                    torch.arange(context.numel()), model.plan.target)
    base, times = context.numel(), []
    for _ in range(rounds):
        start = time.perf_counter()
        target.get_output_embeddings()(decoder_forward(target, context[-n:], cache, causal_mask(base, n, context.device),
                                                       base + torch.arange(n), model.plan.target))
        times.append(1000 * (time.perf_counter() - start))
        cache.crop(base)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct")
    ids_list = prompts(model.tokenizer, args.questions)
    model.generate(ids_list[0][:, :16], max_new_tokens=8)  # warm-up
    totals = {(path, kind): [0, 0.0] for path in PATHS for kind in ("plain", "lossless")}
    outputs = {}
    for qi, ids in enumerate(ids_list):
        for path, in_place in PATHS.items():
            attention.SDPA_GQA = in_place
            for kind, run in (("plain", model.naive_generate), ("lossless", model.generate)):
                out = run(ids, max_new_tokens=args.max_new_tokens, return_dict=True)
                totals[(path, kind)][0] += out.new_tokens
                totals[(path, kind)][1] += out.wall_time
                outputs[(qi, path, kind)] = out.sequences
        print(f"question {qi + 1}/{len(ids_list)} done", flush=True)
    print(f"{args.questions} MT-Bench first turns, {args.max_new_tokens} new tokens, {args.threads} threads, "
          f"tree {model.shape}")
    for path in PATHS:
        plain, spec = (totals[(path, k)][0] / totals[(path, k)][1] for k in ("plain", "lossless"))
        print(f"{path:9s} plain {plain:.2f} tok/s, lossless {spec:.2f} tok/s ({spec / plain:.2f}x its plain)")
    same = sum(torch.equal(outputs[(q, p, "plain")], outputs[(q, p, "lossless")])
               for q in range(len(ids_list)) for p in PATHS)
    across = sum(torch.equal(outputs[(q, "in place", k)], outputs[(q, "copied", k)])
                 for q in range(len(ids_list)) for k in ("plain", "lossless"))
    print(f"lossless = plain: {same}/{2 * len(ids_list)}; in place = copied: {across}/{2 * len(ids_list)}")
    context = outputs[(len(ids_list) - 1, "in place", "plain")][0]
    for n in (1, 4, 8):
        ms = {}
        for path, in_place in PATHS.items():
            attention.SDPA_GQA = in_place
            ms[path] = verify_ms(model, context, n)
        print(f"t_verify({n}) at {context.numel()} tokens: in place {ms['in place']:.1f} ms, copied "
              f"{ms['copied']:.1f} ms")


if __name__ == "__main__":
    main()
