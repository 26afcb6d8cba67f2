"""A/B in one process, arms interleaved: the fused decoder forward (eagle_fsd.fused_decoder) against transformers'
forward, on the Qwen preset at its defaults (int4 x int8 target, int4 0.5B drafter), 2 threads.

1. One forward of each model over n new tokens on a ~200-token cache (median of 15): the target at n = 1 (a plain
   step) and 4 (a small tree), the drafter at n = 1 and 3 (a draft level, a catch-up).
2. Speculative decoding of three prompts twice (each arm first in turn), 128 new tokens each, tree pinned to (4, 1, 2) on the full vocabulary
   (what `auto` picked on this machine class): tokens/s, τ, and whether both arms give the same tokens (the fused
   target forward is transformers' to the bit, so they must).

The transformers arm turns `runs_fused` off for this script's run only (the engine has no switch for it).
    python benchmarks/fused_decoder_ab.py
"""
import statistics
import time

import torch

from eagle_fsd import drafters, hf
from eagle_fsd.cache import TreeCache
from eagle_fsd.hf import causal_mask
from eagle_fsd.model import EaFsdModel

torch.set_grad_enabled(False)
torch.set_num_threads(2)
ARMS = {"transformers": lambda model: False, "fused": hf.runs_fused}
ROUNDS = 2
PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain how a hash map handles collisions, briefly.",
           "Write a bash one-liner that counts the lines of every .py file under a folder."]


def use(arm):
    hf.runs_fused = drafters.runs_fused = ARMS[arm]


def forward_ms(model, forward, n, calls=15):
    g = torch.Generator().manual_seed(0)
    cache = TreeCache.for_model(model, 400)
    forward(model, torch.randint(100, 5000, (200,), generator=g), cache, causal_mask(0, 200, "cpu"),
            torch.arange(200))
    new, positions, mask = torch.randint(100, 5000, (n,), generator=g), torch.arange(200, 200 + n), causal_mask(200, n, "cpu")
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        forward(model, new, cache, mask, positions)
        times.append(time.perf_counter() - start)
        cache.crop(200)
    return statistics.median(times) * 1e3


def main():
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", total_token=4, depth=1, top_k=2, draft_vocab=0,
                                       tune_progress=False)
    drafter = model.drafter

    def draft_forward(m, ids, cache, mask, positions):
        drafter.cache = cache
        return drafter._hidden(ids, None, mask, positions)[0]

    def target_forward(m, ids, cache, mask, positions):
        return hf.decoder_forward(m, ids, cache, mask, positions)

    for name, m, forward, sizes in (("target", model.base_model, target_forward, (1, 4)),
                                    ("drafter", drafter.model, draft_forward, (1, 3))):
        for n in sizes:
            ms = {}
            for arm in ARMS:
                use(arm)
                ms[arm] = forward_ms(m, forward, n)
            print(f"{name} forward, {n} new tokens: transformers {ms['transformers']:.1f} ms, fused {ms['fused']:.1f} ms "
                  f"({ms['transformers'] / ms['fused']:.2f}x)", flush=True)
    tokens = {arm: 0 for arm in ARMS}
    seconds = {arm: 0.0 for arm in ARMS}
    accepted = {arm: [] for arm in ARMS}
    phases = {arm: {} for arm in ARMS}
    same, outs_order = True, []
    for prompt in PROMPTS * ROUNDS:
        ids = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  return_tensors="pt")
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        outs = {}
        for arm in (ARMS if len(outs_order) % 2 == 0 else reversed(list(ARMS))):  # each arm first in turn
            use(arm)
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=128, return_dict=True)
            seconds[arm] += time.perf_counter() - start
            outs[arm] = out.sequences
            tokens[arm] += out.sequences.shape[1] - ids.shape[1]
            accepted[arm].append(out.tau)
            for phase, sec in out.phase_seconds.items():
                phases[arm][phase] = phases[arm].get(phase, 0.0) + sec
        same &= torch.equal(outs["transformers"], outs["fused"])
        outs_order.append(prompt)
    rates = {arm: tokens[arm] / seconds[arm] for arm in ARMS}
    for arm in ARMS:
        split = ", ".join(f"{phase} {sec:.1f}" for phase, sec in phases[arm].items())
        print(f"generate, {arm}: {rates[arm]:.2f} tok/s, tau {statistics.mean(accepted[arm]):.2f}; seconds: {split}")
    print(f"fused / transformers: {rates['fused'] / rates['transformers']:.2f}x; same tokens: {same}")


if __name__ == "__main__":
    main()
