"""llama.cpp as a peer row in `eagle-fsd bench`: plain greedy decoding of a GGUF (by default the preset's own file,
the one the engine's folder was converted from), and llama.cpp with a draft GGUF proposing K tokens a step (the
drafter preset's own file), through llama-cpp-python in this process, question by question between the engine's
methods.

Both rows get the prompt's token ids from the engine's tokenizer (the GGUF carries the same vocabulary), greedy
sampling, the same threads, the same new-token limit and stop tokens, and a cleared cache per question; tok/s counts
prefill as the other rows do. llama-cpp-python builds llama.cpp from source (README, Compare with llama.cpp), so it is
imported only when a row is asked for.
"""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import torch

INSTALL_HINT = ("install it with `pip install llama-cpp-python==0.3.36` (it builds llama.cpp from source, about 8 "
                "minutes on 2 cores; README, Compare with llama.cpp)")


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:
        raise SystemExit(f"--also-llama-cpp needs llama-cpp-python, which is not installed ({exc}): "
                         f"{INSTALL_HINT}") from None
    return llama_cpp


SMOKE_TEST = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
llm.eval(llm.tokenize(b"Hello"))
"""


def smoke_test(gguf: str) -> None:
    """Load the GGUF and run one forward in a child process: a llama.cpp build that crashes on this CPU (a native
    build's AMX matmul under gcc 12 dies with a protection fault) fails here with the fix named, before the bench
    has run anything it could lose."""
    done = subprocess.run([sys.executable, "-c", SMOKE_TEST, str(gguf)], capture_output=True, text=True)
    if done.returncode < 0:
        raise SystemExit(f"llama.cpp crashed (signal {-done.returncode}) on its first forward of {gguf}: on an AMX "
                         "CPU with gcc 12 rebuild llama-cpp-python without AMX (README, Compare with llama.cpp: "
                         "CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX512=ON ...\")")
    if done.returncode:
        raise SystemExit(f"llama.cpp failed on {gguf}: {done.stderr.strip()[-500:]}")


def open_gguf(path: str, threads: int, context: int, logits_all: bool = False, draft_model=None):
    llama_cpp = import_llama_cpp()
    return llama_cpp.Llama(model_path=str(path), n_ctx=context, n_batch=512, n_threads=threads,
                           n_threads_batch=threads, logits_all=logits_all, draft_model=draft_model, verbose=False,
                           seed=0)


class GreedyDraft:
    """llama-cpp-python's draft-model hook (`Llama(draft_model=...)`, called with the ids so far, returns the
    proposed continuation): a second GGUF that keeps its own cache, catches up on the ids it has not seen (the
    target's accepted and corrected tokens) and proposes its `k` greedy tokens."""

    def __init__(self, llm, k: int):
        self.llm, self.k, self.calls = llm, k, 0

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        self.calls += 1
        llm, ids = self.llm, np.asarray(input_ids)
        n = min(llm.n_tokens, len(ids))
        differ = np.flatnonzero(llm.input_ids[:n] != ids[:n])
        common = int(differ[0]) if differ.size else n  # ids the draft's cache already holds
        llm.n_tokens = min(common, len(ids) - 1)  # evaluate at least the last id again, for its logits
        llm.eval(ids[llm.n_tokens:].tolist())
        proposed = []
        for _ in range(self.k):
            proposed.append(int(llm.sample(temp=0.0, top_k=1, repeat_penalty=1.0)))
            if len(proposed) < self.k:
                llm.eval(proposed[-1:])
        return np.array(proposed, dtype=np.intc)


def greedy_method(llm, max_new_tokens: int, stop_ids: set[int], draft: GreedyDraft | None = None):
    """run(ids) -> {"sequences", "wall_time"} (and "target_forwards" with a draft model): llama.cpp's greedy tokens
    after the prompt `ids` (1, n), from an empty cache, until a stop token (kept, as HF generate keeps it) or
    `max_new_tokens`."""
    def run(ids: torch.Tensor) -> dict:
        llm.reset()  # no prefix reuse between questions: every row prefills every prompt
        if draft is not None:
            draft.llm.reset()
            draft.calls = 0
        new = []
        start = time.perf_counter()
        for token in llm.generate(ids[0].tolist(), temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            new.append(int(token))
            if token in stop_ids or len(new) == max_new_tokens:
                break
        wall = time.perf_counter() - start
        seq = torch.cat([ids, torch.tensor([new], dtype=ids.dtype)], dim=1)
        out = {"sequences": seq, "wall_time": wall}
        if draft is not None:  # the prefill, then one verification after each draft
            out["target_forwards"] = 1 + draft.calls
        return out
    return run


def llama_cpp_methods(target_gguf: str, draft_gguf: str | None, threads: int, context: int, max_new_tokens: int,
                      stop_ids: set[int], draft_tokens: int) -> dict:
    """{"llama.cpp": run, "llama.cpp draft K=k": run}: plain greedy on the target GGUF and, with `draft_gguf`,
    llama.cpp verifying `draft_tokens` greedy drafts a step (lossless up to llama.cpp's batch-vs-row rounding)."""
    methods = {"llama.cpp": greedy_method(open_gguf(target_gguf, threads, context), max_new_tokens, stop_ids)}
    if draft_gguf:
        draft = GreedyDraft(open_gguf(draft_gguf, threads, context), draft_tokens)
        # the draft hook needs every position's logits from the target's batched verification
        target = open_gguf(target_gguf, threads, context, logits_all=True, draft_model=draft)
        methods[f"llama.cpp draft K={draft_tokens}"] = greedy_method(target, max_new_tokens, stop_ids, draft)
    return methods
