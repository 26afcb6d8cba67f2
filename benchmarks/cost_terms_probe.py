"""The cost model's terms as the tuner times them against the same terms in real decoding, in one process and in
alternation (so a shared machine's drift moves both alike): the Qwen preset at its defaults, MT-Bench q81-90 first
turns, 128 new tokens, 2 threads. Per round: the tuner's forwards (eagle_fsd.tune.measure.measure_costs at a context
of the run's mean length) for the trees each rule runs, then plain decoding, lossless and FSD kl_qp T = 2 and 8 on
`QUESTIONS` questions. Each term is printed relative to t_plain (a plain step), tuner against loop.

    python benchmarks/cost_terms_probe.py [ROUNDS] [QUESTIONS]
"""
import statistics
import sys

import torch

from eagle_fsd.tune.measure import TuneSettings, measure_costs, timing_context, vocab_ids
from eagle_fsd.eval.bench import load_model, mean_context, parse_args, parse_fsd, prompts

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
QUESTIONS = int(sys.argv[2]) if len(sys.argv) > 2 else 4


def loop_ms(out) -> tuple[float, float]:
    """(verify ms a step, drafting and loop ms a step) of one call, after its prefills."""
    phases = dict(out.phase_seconds)
    phases.pop("draft_prefill", None)
    steps = max(out.verify_steps, 1)
    return 1000 * phases["verify"] / steps, 1000 * (sum(phases.values()) - phases["verify"]) / steps


def main():
    job, _ = parse_args(["--model", "qwen2.5-coder-1.5b-instruct", "--threads", "2"])
    model = load_model(job.settings)
    ids_list = prompts(model.tokenizer, 10)[:QUESTIONS]
    context_len = round(mean_context(prompts(model.tokenizer, 10), 128))
    rules = {"lossless": None, **{f"T={t:g}": r for t, r in zip((2, 8), parse_fsd(["kl_qp:2,8"]))}}
    shapes = {name: model.trees_for(rule).shape for name, rule in rules.items()}
    sizes = sorted({1, *(s.total_token for s in shapes.values())})
    top_ks = sorted({s.branching for s in shapes.values()})
    vocab = next(iter(shapes.values())).draft_vocab
    print(f"context {context_len}, trees {shapes}, sizes {sizes}, top_k {top_ks}, draft vocabulary {vocab}")
    context = timing_context(model, TuneSettings(), context_len)
    for rule in rules.values():  # set-up outside the rounds
        model.generate(ids_list[0][:, :16], max_new_tokens=8, fsd=rule)
    records = []
    with torch.no_grad():
        for r in range(ROUNDS):
            verify, level, extend = measure_costs(model, [context], sizes, top_ks, {vocab: vocab_ids(model, vocab)},
                                                  5)[0]
            plain = [model.naive_generate(ids, max_new_tokens=128, return_dict=True) for ids in ids_list]
            t_plain = statistics.mean(sum(o.phase_seconds.values()) * 1000 / max(o.verify_steps, 1) for o in plain)
            for name, rule in rules.items():
                s = shapes[name]
                outs = [model.generate(ids, max_new_tokens=128, return_dict=True, fsd=rule) for ids in ids_list]
                v_loop = statistics.mean(loop_ms(o)[0] for o in outs)
                d_loop = statistics.mean(loop_ms(o)[1] for o in outs)
                d_tune = s.depth * level[(s.branching, vocab)] + extend[vocab]
                records.append((name, verify[s.total_token] / verify[1], v_loop / t_plain, d_tune / verify[1],
                                d_loop / t_plain))
                print(f"round {r} {name:9s} {s}: verify/t_plain tuner {verify[s.total_token] / verify[1]:.3f} "
                      f"loop {v_loop / t_plain:.3f}; drafting/t_plain tuner (no loop overhead) "
                      f"{d_tune / verify[1]:.3f} loop {d_loop / t_plain:.3f}; t_plain {t_plain:.1f} ms, tuner "
                      f"t_verify(1) {verify[1]:.1f} ms", flush=True)
    for name in rules:
        rs = [x for x in records if x[0] == name]
        print(f"{name:9s} median verify ratio tuner {statistics.median(x[1] for x in rs):.3f} loop "
              f"{statistics.median(x[2] for x in rs):.3f}; drafting tuner {statistics.median(x[3] for x in rs):.3f} "
              f"loop {statistics.median(x[4] for x in rs):.3f}")


if __name__ == "__main__":
    main()
