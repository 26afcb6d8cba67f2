"""What a step costs beside its forwards' products, this version against the one before (REV's decoder_glue.cpp,
default HEAD), in one process with the arms alternating question by question (A B B A ...): the Qwen preset at its
defaults, MT-Bench q81-90 first turns, 128 new tokens, 2 threads; lossless speculation and plain decoding in each arm.
The earlier arm runs REV's attention (one task per query head, scalar sums), re-checks the one-call plan at every
forward, takes draft log-probs with torch's topk and logsumexp, and moves a kept chain's cache entries in place.

    python benchmarks/loop_costs_ab.py [REV]

Prints tok/s per arm and method over the ten questions, the median per-question ratio (after / before), whether
lossless equals plain decoding within each arm, and how many outputs the two arms share (their attention rounds
differently, so a token may move).
"""
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import eagle_fsd.fused_decoder as fused
import eagle_fsd.tree.dynamic as dynamic
from eagle_fsd.cache import TreeCache
from eagle_fsd.eval.data import load_questions
from eagle_fsd.kernels import decoder_glue
from eagle_fsd.kernels.cpp_build import load_extension
from eagle_fsd.model import EaFsdModel
from eagle_fsd.prompts import PromptFormat

REV = sys.argv[1] if len(sys.argv) > 1 else "HEAD"


def earlier_glue(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:kernels/decoder_glue.cpp"], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).parent).stdout
    path = Path(tempfile.mkdtemp()) / "decoder_glue_before.cpp"
    path.write_text(source)
    isa = decoder_glue.vector_isa()
    vector = [decoder_glue.VECTOR_FLAGS[isa][1]] if isa in decoder_glue.VECTOR_FLAGS else []
    return load_extension(f"ab_decoder_glue_{isa}_{rev[:12]}", path, ["-O3", "-fopenmp", "-ffp-contract=off", *vector],
                          ["-fopenmp"])


def main():
    torch.set_num_threads(2)
    before_glue, after_glue = earlier_glue(REV), decoder_glue._extension()
    plan_once, glue_logprobs, keep = fused.rows_plan, dynamic.top_logprobs, TreeCache.keep

    def plan_every_forward(decoder):
        fused._module_registrations[0] += 1
        return plan_once(decoder)

    def torch_logprobs(logits, top_k, draft_vocab=None):
        values, columns = logits.topk(top_k, dim=-1)
        logprobs = values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        return logprobs, columns if draft_vocab is None else draft_vocab[columns]

    def keep_by_layer(cache, start, idx):
        for layer in cache.layers:
            layer.keep(start, idx)

    def use(arm):
        before = arm == "before"
        decoder_glue._extension = (lambda: before_glue) if before else (lambda: after_glue)
        fused.rows_plan = plan_every_forward if before else plan_once
        dynamic.top_logprobs = torch_logprobs if before else glue_logprobs
        TreeCache.keep = keep_by_layer if before else keep

    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", tune_progress=False)
    fmt = PromptFormat(model.tokenizer)
    prompts = [fmt.encode([{"role": "user", "content": q["turns"][0]}]) for q in load_questions()[:10]]
    for arm in ("before", "after"):  # warm both builds
        use(arm)
        model.generate(prompts[0][:, :16], max_new_tokens=8)
    seconds = {(arm, m): [] for arm in ("before", "after") for m in ("lossless", "plain")}
    tokens, outputs = dict.fromkeys(seconds, 0), {key: [] for key in seconds}
    for i, ids in enumerate(prompts):
        for arm in (("before", "after") if i % 2 == 0 else ("after", "before")):
            use(arm)
            for method in ("lossless", "plain"):
                run = model.generate if method == "lossless" else model.naive_generate
                out = run(ids, max_new_tokens=128, return_dict=True)
                seconds[arm, method].append(out.wall_time)
                tokens[arm, method] += out.new_tokens
                outputs[arm, method].append(out.sequences[0].tolist())
    for method in ("lossless", "plain"):
        rates = {arm: tokens[arm, method] / sum(seconds[arm, method]) for arm in ("before", "after")}
        ratios = [b / a for a, b in zip(seconds["after", method], seconds["before", method])]
        print(f"{method:9s} before {rates['before']:6.2f} tok/s  after {rates['after']:6.2f} tok/s  "
              f"after/before {rates['after'] / rates['before']:.3f}  "
              f"median per question {statistics.median(ratios):.3f}")
    for arm in ("before", "after"):
        same = sum(a == b for a, b in zip(outputs[arm, "lossless"], outputs[arm, "plain"]))
        print(f"{arm}: lossless equals plain on {same}/10")
    pairs = list(zip(outputs["before", "plain"], outputs["after", "plain"]))
    prefix = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs]
    print(f"plain outputs equal across arms: {sum(a == b for a, b in pairs)}/10; tokens shared before they part "
          f"(prompt included): {prefix}")


if __name__ == "__main__":
    main()
