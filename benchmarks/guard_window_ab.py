"""The speed guard's window on chat: how many of lossless speculation's steps it hands to plain decoding, and what that
costs, for windows of 16 and 32 speculative steps against no guard (the tuned tree, fixed).

    python benchmarks/guard_window_ab.py [--questions 10] [--rounds 2] [--windows 16,32]

The Qwen preset at its defaults (tuned tree and profile), MT-Bench q81-90 as `eagle-fsd bench` feeds them, 128 new
tokens, 2 threads. Per round the arms run one after another over all questions, each guarded arm with a fresh guard
kept across its questions (as a model keeps it across calls); compare arms within a round (this VM drifts). Prints
tokens/s, the speedup over plain decoding of the same round and the plain steps the guard took; every arm's tokens must
equal plain decoding's.
"""
import argparse
import time

import torch

from eagle_fsd.eval.bench import prompts
from eagle_fsd.guard import GuardMemory, SpeedGuard
from eagle_fsd.model import EaFsdModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--windows", default="16,32")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", tune_progress=False)
    tuning, tree = model.tuning, model.shape
    print(model.plan.summary())
    questions = prompts(model.tokenizer, args.questions)
    model.generate(questions[0][:, :32], max_new_tokens=8, shape=tree)
    reference = [model.naive_generate(ids, max_new_tokens=128) for ids in questions]

    def guarded(window: int):
        def start():  # the model's lossless guard, fresh, with this window
            model._trees.clear()
            model._guards[None] = SpeedGuard(tuning.plain_ms, tuning.verify_ms, window=window, backoff=32,
                                             memory=GuardMemory())
        return start, lambda ids: model.generate(ids, max_new_tokens=128, return_dict=True)

    arms = {f"guard, window {w}": guarded(int(w)) for w in args.windows.split(",")}
    arms["no guard (tree fixed)"] = (lambda: None, lambda ids: model.generate(ids, max_new_tokens=128,
                                                                              return_dict=True, shape=tree))
    arms["plain"] = (lambda: None, lambda ids: model.naive_generate(ids, max_new_tokens=128, return_dict=True))
    for round_ in range(args.rounds):
        rates = {}
        for name, (start, run) in arms.items():
            start()
            tokens, seconds, plain_steps, steps = 0, 0.0, 0, 0
            for ids, want in zip(questions, reference):
                begin = time.perf_counter()
                out = run(ids)
                seconds += time.perf_counter() - begin
                assert torch.equal(out.sequences, want), f"{name}: tokens differ from plain decoding"
                tokens, plain_steps, steps = tokens + out.new_tokens, plain_steps + out.plain_steps, \
                    steps + out.verify_steps
            rates[name] = (tokens / seconds, plain_steps, steps)
        for name, (rate, plain_steps, steps) in rates.items():
            print(f"round {round_ + 1} {name:22s} {rate:6.2f} tok/s  {rate / rates['plain'][0]:.3f}x plain  "
                  f"plain steps {plain_steps}/{steps}", flush=True)


if __name__ == "__main__":
    main()
