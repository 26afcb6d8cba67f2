"""The loader: everything that turns names and options into a ready model. A preset, hub id or directory becomes
a target and tokenizer (dtype "auto" resolved); the drafter is the head or LM named, else the preset's own (an
EAGLE-1/2 head, an EAGLE-3 head in any of its three layouts, told apart by config.json, or a causal LM sharing the
target's tokenizer); weights are prepacked and the drafter's quantized where that pays; "auto" tree settings become
the TreeShape the measured cost model chooses (eagle_fsd.tune). The model class is the caller's
(EaFsdModel.from_pretrained passes itself), so nothing here imports the engine."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from eagle_fsd import presets
from eagle_fsd.attention import ATTENTION_NAME, check_backend
from eagle_fsd.drafting import DRAFTERS, holds_eagle_fc, is_eagle3, read_head_config
from eagle_fsd.dtypes import torch_dtype
from eagle_fsd.fused_decoder import fused_fits
from eagle_fsd.gguf_blocks import blocks_pay
from eagle_fsd.plan import ModelRun, RunPlan, WeightFormat
from eagle_fsd.prepack import PackedLinear
from eagle_fsd.product_store import format_cached
from eagle_fsd.quant import QuantLinear
from eagle_fsd.settings import AUTO, Settings
from eagle_fsd.target_quant import RowQuantLinear, cpu_activation_bits, gguf_share, int4_share, runs_int8_rows
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tune import (autotune, resolve_draft_quant, resolve_dtype, resolve_prepack,
                            resolve_target_quant, target_quant_choice)
from eagle_fsd.tune.dtype import load_device
from eagle_fsd.weights import PREPACKED, format_weights

FORMATTED = (PackedLinear, QuantLinear, RowQuantLinear)  # what the weight step swaps linear layers for
EAGLE_DEFAULTS = (60, 5, 10)  # EAGLE's total_token, depth, top_k
TREE_NAMES = ("total_token", "depth", "branching", "draft_vocab")  # TreeShape's names (and the draft vocabulary)
# inputs per 4-bit scale of an LM drafter's layers: 4.25 bits a weight instead of 5.0 at 32, fewer bytes a draft
# forward for the same tokens a step on chat (benchmarks/drafter_group_ab.py, docs/cpu-kernels.md)
DRAFTER_INT4_GROUP = 128


@dataclass(frozen=True)
class LoadOptions:
    """How from_pretrained loads: each "auto" or forced (see load_pretrained)."""

    dtype: object = "auto"
    device_map: object = None
    attention: str = "auto"
    tune_progress: bool = True
    prepack: object = "auto"
    draft_quant: str = "auto"
    target_quant: str = "auto"


def load_pretrained(cls, base_model: str, drafter: tuple = (None, None), tree: tuple = (None, None, None),
                    options: LoadOptions = LoadOptions(), hf_kwargs: dict | None = None):
    """`cls` (EaFsdModel) loaded and ready, built once. base_model: a preset name, hub id or directory.
    drafter: (ea_model_path, draft_model): an EAGLE-1/2 or EAGLE-3 head (dir or hub id), or a causal LM sharing the
    tokenizer (name, dir, hub id or a loaded model) or a directory holding an EAGLE head. Without either, the preset's
    own drafter (the EAGLE head shipped for it, else its sibling LM).
    tree: EAGLE's (total_token, depth, top_k) and optionally the draft vocabulary size, each an int, "auto" (the
    shape the measured cost model predicts fastest on this machine; measured once, cached, checked at each load;
    plain decoding when nothing pays) or None ("auto" for a preset, else EAGLE's default; see requested_tree).
    options.dtype "auto": bf16 on CUDA; on CPU bf16 only with native bf16 matmul that measures faster, else fp32 (a
    name such as "bf16" or a torch.dtype forces it).
    options.prepack "auto": on CPU (fp32, or bf16 with oneDNN bf16), the linear weights of target and drafter packed
    once for oneDNN (eagle_fsd.prepack) where that measures faster; "on" / "off" (or True / False) force it.
    options.draft_quant "auto": an LM drafter on CPU drafts with int4 weights (eagle_fsd.quant) where that kernel
    measures faster; "int4" / "int8" / "off" force it. Verification keeps the target's weights: still lossless.
    options.target_quant "auto": a preset's target on CPU, loaded with dtype "auto", runs its linear layers
    int8 x int8, or int4 x int8 where its weights are 4-bit already (eagle_fsd.target_quant), where that measures
    faster; "int4" / "int8" / "off" force it. Decoding is then lossless against that quantized model, and the drafter
    is built for it (fp32 activations). The choices are the model's run plan (eagle_fsd.plan), `model.plan`."""
    check_backend(options.attention)
    resolve_draft_quant(options.draft_quant, None)  # a bad spelling fails before anything loads
    target_quant_choice(options.target_quant)
    preset = base_model in presets.PRESETS
    fixed, auto = requested_tree(preset, tree)
    path = presets.resolve_model(base_model)
    kind, source = drafter_source(base_model, *drafter)  # a bad head fails before the target loads
    gguf = presets.gguf_path(base_model) if preset else None
    target, tokenizer, target_format = load_formatted_target(path, preset, options, hf_kwargs or {},
                                                             gguf if gguf is not None and gguf.is_file() else None)
    drafter_model = build_drafter(kind, source, target, tokenizer)
    drafter_format = format_drafter(drafter_model, target_format, options, target)
    shape = TreeShape(*(fixed.get(name, 1) for name in TREE_NAMES[:3]),
                      0 if auto else fixed.get("draft_vocab", 0))
    plan = plan_for(target, drafter_model, shape, (target_format, drafter_format), options.attention)
    model = cls(target, tokenizer, drafter_model, plan=plan)
    if drafter_model is not None and auto:
        model.use_tuning(autotune(model, base_model, drafter_name=source, fixed=fixed, progress=options.tune_progress))
    return model


def load_formatted_target(path: str, preset: bool, options: LoadOptions, hf_kwargs: dict, gguf: Path | None = None):
    """(target, tokenizer, its WeightFormat): loaded in the dtype "auto" resolves to, its linear layers in the
    format chosen for it; a quantized one on the Q4_K / Q6_K blocks of `gguf` (the GGUF it was converted from) where
    that file is given and the blocks' kernel pays on this CPU (`blocks_pay`). A target to be quantized loads as
    stored (its products are rounded from the checkpoint's own weights; a bf16 checkpoint then maps in a second where
    converting it to fp32 takes half a minute); the weight step makes every other parameter fp32."""
    config = AutoConfig.from_pretrained(path)
    run_dtype = resolve_dtype(options.dtype, options.device_map, config, options.prepack)
    run_dtype = torch_dtype(run_dtype) if isinstance(run_dtype, str) else run_dtype
    target_bits = resolve_target_quant(options.target_quant, config, run_dtype, load_device(options.device_map),
                                       preset, options.dtype != "auto", options.prepack)
    load_dtype = "auto" if target_bits and options.dtype == "auto" else run_dtype
    target, tokenizer = load_target(path, load_dtype, options.device_map, hf_kwargs)
    if target_bits:
        fmt = WeightFormat("rows", activation_bits=cpu_activation_bits(), four_bit=target_bits == 4,
                           gguf=str(gguf) if gguf is not None and target_bits == 4 and blocks_pay() else None)
    else:
        fmt = PREPACKED if resolve_prepack(options.prepack, target) else WeightFormat()
    format_cached(target, fmt)
    return target, tokenizer, fmt


def format_drafter(drafter, target_format: WeightFormat, options: LoadOptions, target) -> WeightFormat | None:
    """The drafter's weights in the format chosen for them. With a quantized target, an LM drafter on draft_quant
    "auto" runs the same kernels: where the target's run int4, every drafter layer is rounded to int4 (4-bit already
    or not: a drafter's rounding moves acceptance only, and half the bytes of int8 make each draft forward cheaper),
    else int8; its inputs are fp32 then, its int4 groups DRAFTER_INT4_GROUP inputs where they divide a row. Otherwise
    it is prepacked with the target, then rounded as draft_quant resolves (prepack "auto" judged on the target as it
    runs now)."""
    if drafter is None:
        return None
    if target_format.quantized_rows and options.draft_quant == "auto" and drafter.auto_quant:
        four_bit = int4_share(target) > 0
        fmt = WeightFormat("rows", activation_bits=target_format.activation_bits, four_bit=four_bit,
                           requantize=four_bit, exact=False, int4_group=DRAFTER_INT4_GROUP)
        format_cached(drafter.module, fmt)
        return fmt
    prepacked = resolve_prepack(options.prepack, target)
    fmt = PREPACKED if prepacked else WeightFormat()
    format_weights(drafter.module, fmt)
    bits = resolve_draft_quant(options.draft_quant, drafter, prepacked)
    if bits:  # a prepacked layer keeps its packed weight for many rows (eagle_fsd.quant)
        fmt = WeightFormat(f"int{bits}")
        format_weights(drafter.module, fmt)
    return fmt


def plan_for(target, drafter=None, tree: TreeShape = TreeShape(*EAGLE_DEFAULTS), formats: tuple = (None, None),
             backend: str = "auto") -> RunPlan:
    """The run plan of `target` and `drafter` whose weights are in `formats` (target's, drafter's; None: float), the
    draft tree `tree`, attention by `backend`: the one place where what the loader made is turned into how it runs."""
    target_format, drafter_format = (fmt or WeightFormat() for fmt in formats)
    target_run = model_run(target, target_format, backend, exact=True, decoder=True)
    drafter_run = None if drafter is None else model_run(drafter.module, drafter_format, backend, exact=False,
                                                         decoder=drafter.is_decoder)
    return RunPlan(target_run, drafter_run, ((None, tree),))


def model_run(module, fmt: WeightFormat, backend: str, exact: bool, decoder: bool) -> ModelRun:
    """How `module`, its weights in `fmt`, runs: a decoder through the fused forward where it fits
    (eagle_fsd.fused_decoder)."""
    formatted = [type(m).__name__ for m in module.modules() if isinstance(m, FORMATTED)]
    if fmt.kind == "float" and formatted:
        raise ValueError(f"this model's linear layers were swapped ({formatted[0]}) but its weight format is given as "
                         "float: pass the WeightFormat they were swapped for (plan_for(..., formats=...))")
    rows = fmt.quantized_rows
    return ModelRun(dtype=next(module.parameters()).dtype, weights=fmt, fused=decoder and fused_fits(module),
                    exact=exact, backend=backend, int4_share=int4_share(module) if rows else 0.0,
                    int8_rows=rows and runs_int8_rows(module), gguf_share=gguf_share(module) if rows else 0.0)


def requested_tree(preset: bool, tree: tuple) -> tuple[dict, list[str]]:
    """({TreeShape field: int} of the values given, [fields left to the cost model]) from EAGLE's (total_token,
    depth, top_k) and the draft vocabulary size; unset values are "auto" for a preset, else EAGLE's defaults; an
    unset draft vocabulary is "auto" while another value is, else 0 (the full vocabulary). Checked before anything
    loads."""
    values = [("auto" if preset else default) if value is None else value
              for value, default in zip(tree[:3], EAGLE_DEFAULTS)]
    draft_vocab = tree[3] if len(tree) > 3 else None
    values.append((AUTO if AUTO in values else 0) if draft_vocab is None else draft_vocab)
    TreeShape(*(1 if v == AUTO else v for v in values[:3]), 0 if values[3] == AUTO else values[3])  # bad values fail
    fixed = {name: v for name, v in zip(TREE_NAMES, values) if v != AUTO}
    return fixed, [name for name, v in zip(TREE_NAMES, values) if v == AUTO]


def load_target(path: str, dtype, device_map, hf_kwargs: dict):
    """(target model, tokenizer) in `dtype` (a torch.dtype, or "auto": as the checkpoint stores it)."""
    load = dict(dtype=dtype, device_map=device_map, attn_implementation=ATTENTION_NAME, **hf_kwargs)
    return AutoModelForCausalLM.from_pretrained(path, **load).eval(), AutoTokenizer.from_pretrained(path)


def as_hf_runs_it(module, run: ModelRun | None):
    """`module` as a user of HF generate runs it: itself where its weights are as loaded, else (its linear layers
    swapped by the weight step) a fresh copy from the same folder, in the dtype it runs in, or for row-quantized ones in
    the dtype its config names (the baseline rows of `run` and `bench`)."""
    if module is None or run is None or run.weights.kind == "float":
        return module
    dtype = "auto" if run.weights.quantized_rows else run.dtype
    return AutoModelForCausalLM.from_pretrained(module.name_or_path, dtype=dtype).eval()


# ---------------------------------------------------------------- the drafter
def drafter_source(base_model: str, ea_model_path: str | None, draft_model) -> tuple[str | None, object]:
    """The one head-kind detector: (kind, what to load it from), kind "eagle3" or "eagle" (an EAGLE head; config.json
    tells EAGLE-3 layouts apart), "lm" (a causal LM) or None (no drafter). A draft_model that is a local directory
    holding EAGLE weights is a head; with neither given, the preset's own drafter (shipped head, else sibling LM)."""
    if ea_model_path is None and draft_model is None:
        ea_model_path = presets.shipped_head(base_model)
        draft_model = None if ea_model_path is not None else presets.default_drafter(base_model)
    if ea_model_path is None and isinstance(draft_model, str) and Path(draft_model).is_dir() \
            and holds_eagle_fc(draft_model):
        ea_model_path, draft_model = draft_model, None
    if ea_model_path is not None:  # a missing directory or config.json is reported here, by name
        return ("eagle3" if is_eagle3(read_head_config(ea_model_path)) else "eagle"), ea_model_path
    return (None if draft_model is None else "lm"), draft_model


def drafter_name(base_model: str, ea_model_path: str | None, draft_model) -> object:
    """What names the drafter in tuning caches: the head or LM given, else the preset's own."""
    return drafter_source(base_model, ea_model_path, draft_model)[1]


def build_drafter(kind: str | None, source, target, tokenizer):
    """The drafter of `kind` (drafter_source) for `target`, by the registry eagle_fsd.drafting.DRAFTERS: an EAGLE-3 or
    EAGLE-1/2 head from a directory or hub id, or an LM from a name (preset, directory or hub id) or a loaded model;
    None for no drafter."""
    if kind is None:
        return None
    if kind == "lm" and isinstance(source, str):
        source = presets.resolve_model(source)
    return DRAFTERS[kind](source, target, tokenizer)


# ---------------------------------------------------------------- command settings
def load_model(cls, settings: Settings):
    """`cls` loaded for a command's settings. Speculative decoding (not the baseline) needs a drafter: none is a
    usage error."""
    m, tree = settings.model, settings.tree
    if m.threads:
        torch.set_num_threads(m.threads)
    model = cls.from_pretrained(m.model, ea_model_path=m.ea_model_path, draft_model=m.drafter,
                                total_token=tree.total_token, depth=tree.depth, top_k=tree.top_k,
                                draft_vocab=tree.draft_vocab, dtype=m.dtype,
                                device_map=m.device, attention=m.attention, prepack=m.prepack,
                                draft_quant=m.draft_quant, target_quant=m.target_quant)
    if model.drafter is None and not settings.generation.baseline:
        raise SystemExit(f"{m.model!r} has no default drafter: pass --drafter MODEL_OR_HEAD_DIR or "
                         "--ea-model-path HEAD, or --baseline for plain decoding")
    return model
