"""Plain decoding of the Qwen preset with its target's int4 products on this tree's kernel against the kernel's source
at another git revision, in one process: the same model and forward plan, only the int4 entry address its one-call
forwards (decoder_glue.rows_forward) call swapped between rounds. Both must give the same tokens.

The preset with a fixed tree (no tuning), MT-Bench q81-86 as `eagle-fsd bench` feeds them, 96 new tokens, 2 threads;
per round each arm decodes all questions, arms in alternating order; printed: ms a target step (the loop's verify
phase) per arm and round, and the median of the per-round ratios. Where the GGUF blocks pay (the AVX-512 VNNI build)
the target runs none of its layers int4: `ATEN_CPU_CAPABILITY=avx2` runs an AVX2-only CPU's products on a newer CPU
(int4 where the GGUF is 4-bit, int8_rows' 7-bit AVX2 build elsewhere, one C++ call a forward).

    ATEN_CPU_CAPABILITY=avx2 python benchmarks/int4_revision_step_ab.py [--against 893fd33] [--rounds 5]
"""
import argparse
import statistics

import torch

from eagle_fsd.eval.bench import prompts
from eagle_fsd.fused_decoder import rows_plan
from eagle_fsd.kernels import int4_rows as k4
from eagle_fsd.model import EaFsdModel
from int4_revision_ab import build_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="893fd33")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--questions", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", total_token=3, depth=1, top_k=1, draft_vocab=0,
                                       tune_progress=False)
    print(model.plan.summary())
    isa = k4.int4_rows_isa()
    entries = {"this tree": k4._extension(isa).entry(), args.against: build_at(args.against, isa).entry()}
    calls = rows_plan(model.base_model.model).calls
    int4_calls = [call for call in (calls or []) if call[2] == entries["this tree"]]
    if not int4_calls:
        raise SystemExit("the target's one-call forward runs no int4 product here (see the docstring)")
    print(f"int4 build {isa}: {len(int4_calls)} of the target's {len(calls)} kernel calls a forward")
    questions = prompts(model.tokenizer, args.questions)
    model.naive_generate(questions[0][:, :16], max_new_tokens=8)
    outputs, ms = {}, {name: [] for name in entries}
    for round_ in range(args.rounds):
        for name in (list(entries) if round_ % 2 == 0 else list(entries)[::-1]):
            for call in int4_calls:
                call[2] = entries[name]
            verify, steps, tokens = 0.0, 0, []
            for ids in questions:
                out = model.naive_generate(ids, max_new_tokens=96, return_dict=True)
                verify, steps = verify + out.phase_seconds["verify"], steps + out.verify_steps
                tokens.append(out.sequences)
            ms[name].append(1000 * verify / steps)
            assert all(torch.equal(a, b) for a, b in zip(outputs.setdefault(name, tokens), tokens))
        print(f"round {round_ + 1}: " + ", ".join(f"{name} {ms[name][-1]:.2f} ms a step" for name in entries),
              flush=True)
    assert all(torch.equal(a, b) for a, b in zip(*outputs.values())), "the two kernels' tokens differ"
    ratios = [a / b for a, b in zip(ms["this tree"], ms[args.against])]
    print(f"this tree / {args.against}: {statistics.median(ratios):.3f} (rounds: "
          + ", ".join(f"{r:.3f}" for r in ratios) + "); tokens identical")


if __name__ == "__main__":
    main()
