"""Speed benchmark in one process: HF `generate` greedy (the user's alternative) vs HF assisted generation with the
same drafter vs this engine (lossless, and FSD rows), on the same MT-Bench first turns.

    python -m eagle_fsd.eval.bench --model qwen2.5-coder-1.5b-instruct --questions 10 --threads 2
    python -m eagle_fsd.eval.bench --model smollm2-135m-instruct --questions 10 --threads 2
    python -m eagle_fsd.eval.bench ... --fsd kl_qp:0.5,2 --fsd tv:0.3   # FSD sweep rows
    python -m eagle_fsd.eval.bench ... --also-vllm .venv-vllm/bin/python   # vLLM CPU rows (eval/vllm_peer.py)
    python -m eagle_fsd.eval.bench ... --also-llama-cpp   # llama.cpp on the preset's own GGUF (eval/llama_cpp_peer.py)

Methods run question by question in turn (slow drift of the machine hits all alike). Speedups are total tokens /
total seconds against HF generate, and per question; τ = tokens per target forward, bonus included. With the
tree left on "auto" the cost model's predicted speedup (over plain decoding through the loop, `plain` row) is
printed beside the measured one.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM

from eagle_fsd.dtypes import torch_dtype
from eagle_fsd.eval.arms import guard_label, guards_of, parse_guards
# the totals, summary and table live in bench_report; their names stay importable from here (bench.summarize_rows, ...)
from eagle_fsd.eval.bench_report import (PHASES, add_engine_counts, add_identity, add_predictions, add_vllm_rows,
                                         lossy, peer, print_table, same_as_plain, sequences_and_time, shared_prefix,
                                         summarize, summarize_rows)
from eagle_fsd.eval.data import load_questions
from eagle_fsd.eval.llama_cpp_peer import import_llama_cpp, llama_cpp_methods, smoke_test
from eagle_fsd.eval.vllm_peer import VllmJob, run_rows
from eagle_fsd.fsd import FsdConfig
from eagle_fsd.drafting import LMDrafter
from eagle_fsd.loading import as_hf_runs_it, plan_for
from eagle_fsd.model import EaFsdModel, eos_token_ids, load_model
from eagle_fsd.steps import tree_label
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tune.follow import rule_prediction
from eagle_fsd.prompts import PromptFormat
from eagle_fsd.presets import PRESETS, default_drafter, fetch_gguf, resolve_model
from eagle_fsd.settings import Settings, add_fsd_args, add_model_args, add_threads_arg, parse_settings


@dataclass(frozen=True)
class BenchJob:
    """One `eagle-fsd bench` run: the settings (greedy; the FSD rows take the mode from settings.fsd), how many
    MT-Bench first turns, and which methods beside HF generate and eagle-fsd."""

    settings: Settings
    questions: int = 10
    question_file: str | None = None
    hf_assisted: bool = True
    plain: bool = True
    fsd_rows: list[FsdConfig] = field(default_factory=list)  # one row per (divergence, T)
    also_tree: list[str] = field(default_factory=list)  # "TOTAL_TOKEN,DEPTH,TOP_K"
    fsd_on_lossless_tree: bool = False  # each FSD row also on the lossless rule's tree, fixed
    also_hf_dtype: list[str] = field(default_factory=list)  # HF generate on a copy of the target in these dtypes
    also_full_drafter: bool = False  # eagle-fsd again with a quantized drafter's original weights
    also_vllm: str | None = None  # the vLLM environment's Python: vLLM rows (plain, the drafter, FSD)
    vllm_draft_tokens: int = 3  # drafts per step in vLLM's rows
    vllm_dtype: str = "auto"  # vLLM's dtype: auto is the checkpoint's, what a vLLM user gets
    also_llama_cpp: str | None = None  # a GGUF for llama.cpp's plain row; "" = the preset's own file
    llama_cpp_draft: str | None = ""  # a GGUF drafting for it; "" = the drafter preset's own file; None = no row
    llama_cpp_draft_tokens: int = 3  # drafts per step in llama.cpp's draft row


def parse_fsd(specs: list[str], mode: str = "reducible") -> list[FsdConfig]:
    """["kl_qp:0.5,2", "tv+stop:0.3"] -> kl_qp at T = 0.5 and 2, tv at 0.3 with stop tokens kept (guards as in the
    sweep's arm specs: +stop, +rN, +mX, +hX)."""
    rows = []
    for spec in specs:
        head, _, values = spec.partition(":")
        if not values:
            raise SystemExit(f"--fsd {spec!r}: expected DIVERGENCE[+GUARD...]:T1,T2,... e.g. kl_qp:0.5,2 or "
                             "kl_qp+stop:2")
        name, *codes = head.split("+")
        guards = parse_guards(codes)
        rows += [FsdConfig(float(v), name, mode, **guards) for v in values.split(",")]
    return rows


def fsd_row_name(fsd: FsdConfig) -> str:
    return f"fsd {fsd.divergence}{guard_label(guards_of(fsd))} T={fsd.threshold:g}"


def prompts(tokenizer, n: int, path=None) -> list[torch.Tensor]:
    """The first turns of the first n questions, through the model's chat template."""
    fmt = PromptFormat(tokenizer)
    return [fmt.encode([{"role": "user", "content": q["turns"][0]}]) for q in load_questions(path)[:n]]


def hf_method(target, max_new_tokens: int, assistant=None):
    """HF generate greedy, optionally assisted by `assistant` (HF's own speculative decoding), with the plain
    `F.linear` kernels as users run it (as_hf_runs_it: no prepacked or rounded weights)."""
    def run(ids):
        start = time.perf_counter()
        seq = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_new_tokens, assistant_model=assistant)
        return {"sequences": seq, "wall_time": time.perf_counter() - start}
    return run


def gguf_for(name_or_path: str, flag: str) -> str:
    """A preset's own GGUF (fetched and checked), or the path given."""
    if name_or_path in PRESETS:
        return str(fetch_gguf(name_or_path))
    if not os.path.isfile(name_or_path):
        raise SystemExit(f"{flag} {name_or_path!r}: no such file; pass a GGUF file or a preset name "
                         f"({', '.join(sorted(PRESETS))}), whose own GGUF is fetched")
    return name_or_path


def llama_cpp_ggufs(job: BenchJob) -> tuple[str, str | None]:
    """(target GGUF, draft GGUF or None) for llama.cpp's rows: by default the presets' own files."""
    m = job.settings.model
    if job.also_llama_cpp:
        target = gguf_for(job.also_llama_cpp, "--also-llama-cpp")
    elif m.model in PRESETS:
        target = gguf_for(m.model, "--also-llama-cpp")
    else:
        raise SystemExit(f"--also-llama-cpp: --model {m.model!r} is not a preset, so it has no GGUF of its own; "
                         "pass the GGUF: --also-llama-cpp PATH.gguf")
    draft = job.llama_cpp_draft
    if draft == "":  # the drafter preset's own file, when the engine drafts with a preset LM
        drafter = m.drafter or default_drafter(m.model)
        draft = drafter if drafter in PRESETS and not m.ea_model_path else None
    return target, (gguf_for(draft, "--llama-cpp-draft") if draft else None)


def methods_for(model, job: BenchJob, target, ids_list) -> dict:
    """Each method's run(ids); `target`: the target as HF generate users run it (as_hf_runs_it)."""
    n = job.settings.generation.max_new_tokens
    methods = {"hf-generate": hf_method(target, n)}
    if job.plain:
        methods["plain"] = lambda ids: model.naive_generate(ids, max_new_tokens=n, return_dict=True)
    for name in job.also_hf_dtype:  # e.g. fp32 beside a bf16 model: the user's other plain alternative
        copy = AutoModelForCausalLM.from_pretrained(resolve_model(job.settings.model.model),
                                                    dtype=torch_dtype(name)).eval()
        methods[f"hf-generate {name}"] = hf_method(copy, n)
        hf_method(copy, 4)(torch.tensor([[1, 2, 3, 4]]))  # warm-up, as for the loaded model in `run`
    assistant = as_hf_runs_it(model.drafter.assistant_model, model.plan.drafter)
    if job.hf_assisted and assistant is not None:
        methods["hf-assisted"] = hf_method(target, n, assistant)
    methods["eagle-fsd"] = lambda ids: model.generate(ids, max_new_tokens=n, return_dict=True)
    if job.also_full_drafter:  # the before of draft_quant: the same loop and tree, the drafter's original weights
        methods["eagle-fsd drafter as loaded"] = full_drafter_method(model, n)
    for spec in job.also_tree:  # a fixed tree with the full draft vocabulary, no guard (e.g. the old default)
        methods[f"eagle-fsd tree {spec}"] = fixed_tree_method(model, spec, n)
    if job.also_llama_cpp is not None:
        target_gguf, draft_gguf = llama_cpp_ggufs(job)
        context = max(int(ids.numel()) for ids in ids_list) + n + job.llama_cpp_draft_tokens + 8
        methods.update(llama_cpp_methods(target_gguf, draft_gguf, torch.get_num_threads(), context, n,
                                         eos_token_ids(model.base_model), job.llama_cpp_draft_tokens))
    for fsd in job.fsd_rows:
        methods[fsd_row_name(fsd)] = (lambda fsd: lambda ids: model.generate(
            ids, max_new_tokens=n, fsd=fsd, return_dict=True))(fsd)
        if job.fsd_on_lossless_tree:
            methods[f"{fsd_row_name(fsd)} lossless tree"] = (lambda fsd, tree: lambda ids: model.generate(
                ids, max_new_tokens=n, fsd=fsd, return_dict=True, shape=tree))(fsd, model.plan.tree)
    return methods


def rule_predictions(model, job: BenchJob, context_tokens: float | None = None) -> dict[str, dict]:
    """Each rule's tree before the timed runs (an FSD rule's is chosen from its replayed rescue rate) and what the
    cost model predicts for it there (eagle_fsd.tune.follow), with the costs at `context_tokens` cached tokens
    (CostProfile.at_context; None: where they were timed)."""
    if model.tuning is None or model.tuning.profile is None:
        return {}
    profile = prediction_profile(model, context_tokens)
    out = {}
    for name, rule in [("eagle-fsd", None), *((fsd_row_name(f), f) for f in job.fsd_rows)]:
        trees = model.trees_for(rule)
        predicted = rule_prediction(profile, trees.shape, trees.rescue)
        out[name] = {"first_tree": tree_label(trees.shape), "rescue": round(trees.rescue, 3),
                     **{k: round(v, 3) for k, v in predicted.items()}}
    return out


def prediction_profile(model, context_tokens: float | None):
    """The tuned profile with its costs at the run's mean context (None: untuned)."""
    profile = None if model.tuning is None else model.tuning.profile
    if profile is None or context_tokens is None:
        return profile
    return profile.at_context(context_tokens)


def mean_context(ids_list: list[torch.Tensor], max_new_tokens: int) -> float:
    """The tokens cached at an average step of the run: mean prompt length + half the new tokens."""
    return sum(ids.shape[-1] for ids in ids_list) / len(ids_list) + max_new_tokens / 2


def full_drafter_method(model, max_new_tokens: int):
    """The same target, loop and tree, the LM drafter loaded afresh with its weights as stored (the before of
    draft_quant)."""
    module = as_hf_runs_it(model.drafter.assistant_model, model.plan.drafter)
    if module is None:
        raise SystemExit("--also-full-drafter needs an LM drafter")
    drafter = LMDrafter(module.to(model.plan.target.dtype), model.drafter.vocab_size)
    plan = plan_for(model.base_model, drafter, model.shape, (model.plan.target.weights, None),
                    model.plan.target.backend)
    as_loaded = EaFsdModel(model.base_model, model.tokenizer, drafter, plan=plan)
    return lambda ids: as_loaded.generate(ids, max_new_tokens=max_new_tokens, return_dict=True)


def fixed_tree_method(model, spec: str, max_new_tokens: int):
    """`spec` "TOTAL_TOKEN,DEPTH,TOP_K": that tree, the drafter's full vocabulary, no speed guard."""
    values = tuple(int(x) for x in spec.split(","))
    if len(values) != 3:
        raise SystemExit(f"--also-tree {spec!r}: expected TOTAL_TOKEN,DEPTH,TOP_K e.g. 24,5,4")
    shape = TreeShape(*values)
    return lambda ids: model.generate(ids, max_new_tokens=max_new_tokens, return_dict=True, shape=shape)


def warm_up_rules(model, rules: list[FsdConfig], ids: torch.Tensor) -> None:
    """One short untimed call per rule (and lossless): a rule's first call pays its set-up (its divergence pass, its
    tree's replay), which is not decoding speed."""
    for rule in [None, *rules]:
        model.generate(ids[:, :16], max_new_tokens=8, fsd=rule)


def run(job: BenchJob) -> dict:
    """Load the model, time every method on every question, and summarize (what print_table prints)."""
    torch.manual_seed(0)
    model = load_model(job.settings)
    loaded_rss = peak_rss_gb()  # the engine's models, before any baseline copy loads
    ids_list = prompts(model.tokenizer, job.questions, job.question_file)
    hf_target = as_hf_runs_it(model.base_model, model.plan.target)
    methods = methods_for(model, job, hf_target, ids_list)
    context = mean_context(ids_list, job.settings.generation.max_new_tokens)
    predictions = rule_predictions(model, job, context)
    first_tree = model.trees_for(None).shape if model.tuning is not None else None  # lossless' tree there
    warm_up_rules(model, job.fsd_rows, ids_list[0])
    hf_method(hf_target, 8)(ids_list[0][:, :16])
    vllm = run_rows(job.also_vllm, vllm_job(model, job, ids_list)) if job.also_vllm else None
    totals, per_question, reference = time_methods(methods, ids_list)
    if vllm is not None:
        add_vllm_rows(vllm["rows"], ids_list, reference, totals, per_question)
    profile = prediction_profile(model, context)
    result = summarize(model, job.settings, ids_list, totals, per_question, profile, first_tree)
    add_predictions(result, predictions, profile)
    result["prediction_context_tokens"] = round(context, 1)
    if vllm is not None:
        result["vllm_version"], result["vllm_dtype"] = vllm["version"], vllm["dtype"]
    result["peak_rss_gb_engine_loaded"] = loaded_rss
    return result


def time_methods(methods: dict, ids_list) -> tuple[dict, dict, list]:
    """Every method on every question, each question by all methods in turn: (totals per method, tokens/s per method
    and question, HF generate's outputs by question)."""
    totals = {m: defaultdict(float) for m in methods}
    per_question = {m: [] for m in methods}
    references = {"hf-generate": [], "plain": [], "llama.cpp": []}  # outputs by question (add_identity)
    for qi, ids in enumerate(ids_list):
        for name, fn in methods.items():
            out = fn(ids)
            seq, wall = sequences_and_time(out)
            t = totals[name]
            tokens = seq.shape[1] - ids.shape[1]
            t["tokens"] += tokens
            t["seconds"] += wall
            per_question[name].append(tokens / wall)
            add_engine_counts(t, out)
            add_identity(t, name, seq, ids.shape[1], qi, references)
        print(f"question {qi + 1}/{len(ids_list)} done", flush=True)
    return totals, per_question, references["hf-generate"]


def vllm_job(model, job: BenchJob, ids_list) -> VllmJob:
    """The same prompts, target and LM drafter for vLLM (no speculative rows when the engine drafts with a head)."""
    m = job.settings.model
    lm_drafter = model.drafter is not None and model.drafter.assistant_model is not None
    drafter = resolve_model(m.drafter or default_drafter(m.model)) if lm_drafter else None
    if drafter is None:
        print("vLLM: plain row only (its speculative rows need an LM drafter; this engine drafts with a head)")
    fsd = [(f.divergence, f.threshold) for f in job.fsd_rows if f.mode == "reducible" and not f.guarded]
    return VllmJob(resolve_model(m.model), drafter, job.vllm_dtype,
                   [ids[0].tolist() for ids in ids_list], job.settings.generation.max_new_tokens,
                   torch.get_num_threads(), job.vllm_draft_tokens, fsd)


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, GB (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def parse_args(argv) -> tuple[BenchJob, str | None]:
    """(the job, the --json path)."""
    p = argparse.ArgumentParser(prog="eagle-fsd bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, max_new_flag=("--max-new-tokens", "--max-new-token"), max_new_default=128, baseline_flag=False)
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--question-file", default=None, help="FastChat question.jsonl (default: MT-Bench)")
    p.add_argument("--no-hf-assisted", dest="hf_assisted", action="store_false")
    p.add_argument("--no-plain", action="store_true", help="skip plain decoding through this engine's loop")
    p.add_argument("--fsd", action="append", default=[], help="DIVERGENCE:T1,T2,... (repeatable)")
    p.add_argument("--also-tree", action="append", default=[],
                   help="TOTAL_TOKEN,DEPTH,TOP_K: also run this fixed tree, full draft vocabulary (repeatable)")
    p.add_argument("--fsd-on-lossless-tree", action="store_true",
                   help="each --fsd row also on the lossless rule's tree, fixed (what the rule's own tree buys)")
    p.add_argument("--also-hf-dtype", action="append", default=[], choices=("bf16", "fp16", "fp32"),
                   help="also time HF generate on a copy of the target in this dtype (repeatable)")
    add_fsd_args(p, threshold_flag=False, divergence_flag=False)  # --fsd-mode; --fsd gives divergences and T
    p.add_argument("--also-full-drafter", action="store_true",
                   help="with an int4 / int8 drafter (--draft-quant), also run eagle-fsd with the drafter's original "
                        "weights, same tree: what quantizing it saves, in the same run")
    p.add_argument("--also-vllm", default=None, metavar="PYTHON",
                   help="also run vLLM on the CPU (plain, the same LM drafter, the --fsd rows through the eagle_fsd "
                        "plugin) with this vLLM environment's Python, e.g. .venv-vllm/bin/python")
    p.add_argument("--vllm-draft-tokens", type=int, default=3, help="drafts per step in the vLLM rows")
    p.add_argument("--vllm-dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="vLLM's dtype (auto: the checkpoint's, vLLM's default)")
    p.add_argument("--also-llama-cpp", nargs="?", const="", default=None, metavar="GGUF",
                   help="also run llama.cpp (llama-cpp-python, greedy, same prompts and threads) on this GGUF or "
                        "preset; without a value, the preset's own GGUF file")
    p.add_argument("--llama-cpp-draft", default="", metavar="GGUF",
                   help="the draft GGUF (or preset) for llama.cpp's draft row (default: the drafter preset's own "
                        "file; 'none': no draft row)")
    p.add_argument("--llama-cpp-draft-tokens", type=int, default=3, help="drafts per step in llama.cpp's draft row")
    p.add_argument("--json", default=None, help="write the results here")
    add_threads_arg(p)
    args = p.parse_args(argv)
    settings = parse_settings(p, args)
    fsd_rows = parse_fsd(args.fsd, settings.fsd.mode)
    job = BenchJob(settings, args.questions, args.question_file, args.hf_assisted, not args.no_plain, fsd_rows,
                   args.also_tree, args.fsd_on_lossless_tree, args.also_hf_dtype, args.also_full_drafter, args.also_vllm,
                   args.vllm_draft_tokens, args.vllm_dtype, args.also_llama_cpp,
                   None if args.llama_cpp_draft == "none" else args.llama_cpp_draft, args.llama_cpp_draft_tokens)
    return job, args.json


def main(argv=None) -> int:
    job, json_path = parse_args(argv)
    if job.also_llama_cpp is not None:  # fail before minutes of loading: llama-cpp-python and both GGUFs are there
        import_llama_cpp()
        for gguf in filter(None, llama_cpp_ggufs(job)):
            smoke_test(gguf)
    result = run(job)
    print_table(result)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
