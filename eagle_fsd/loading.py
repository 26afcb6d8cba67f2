"""The loader: everything that turns names and options into a ready model. A preset, hub id or directory becomes
a target and tokenizer (dtype "auto" resolved); the drafter is the head or LM named, else the preset's own (an
EAGLE-1/2 head, an EAGLE-3 head in any of its three layouts, told apart by config.json, or a causal LM sharing the
target's tokenizer); weights are prepacked and the drafter's quantized where that pays; "auto" tree settings become
the TreeShape the measured cost model chooses (eagle_fsd.tune). The model class is the caller's
(EaFsdModel.from_pretrained passes itself), so nothing here imports the engine."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from eagle_fsd import presets
from eagle_fsd.attention import ATTENTION_NAME, check_backend
from eagle_fsd.drafters import EagleDrafter, LMDrafter, load_eagle_head, read_head_config
from eagle_fsd.dtypes import torch_dtype
from eagle_fsd.eagle3 import Eagle3Drafter, is_eagle3, load_eagle3_head
from eagle_fsd.prepack import prepack_linears
from eagle_fsd.product_store import quantize_cached
from eagle_fsd.quant import quantize_linears
from eagle_fsd.settings import AUTO, Settings
from eagle_fsd.target_quant import activation_bits, int4_share, is_target_quantized
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tune import (autotune, cpu_flags, resolve_draft_quant, resolve_dtype, resolve_prepack,
                            resolve_target_quant, target_quant_choice)
from eagle_fsd.tune.dtype import load_device

EAGLE_DEFAULTS = (60, 5, 10)  # EAGLE's total_token, depth, top_k
TREE_NAMES = ("total_token", "depth", "branching", "draft_vocab")  # TreeShape's names (and the draft vocabulary)


def load_pretrained(cls, base_model: str, ea_model_path: str | None = None, draft_model=None,
                    tree: tuple = (None, None, None), dtype="auto", device_map=None, attention: str = "auto",
                    tune_progress: bool = True, prepack="auto", draft_quant="auto", target_quant="auto", **kwargs):
    """`cls` (EaFsdModel) loaded and ready. base_model: a preset name, hub id or directory. ea_model_path: an
    EAGLE-1/2 or EAGLE-3 head (dir or hub id); draft_model: a causal LM sharing the tokenizer (name, dir, hub id or a
    loaded model) or a directory holding an EAGLE head. Without either, the preset's own drafter (the EAGLE head
    shipped for it, else its sibling LM).
    tree: EAGLE's (total_token, depth, top_k) and optionally the draft vocabulary size, each an int, "auto" (the
    shape the measured cost model predicts fastest on this machine; measured once, cached, checked at each load;
    plain decoding when nothing pays) or None ("auto" for a preset, else EAGLE's default; see requested_tree).
    dtype "auto": bf16 on CUDA; on CPU bf16 only with native bf16 matmul that measures faster, else fp32 (a name such
    as "bf16" or a torch.dtype forces it).
    prepack "auto": on CPU (fp32, or bf16 with oneDNN bf16), the linear weights of target and drafter packed once
    for oneDNN (eagle_fsd.prepack) where that measures faster; "on" / "off" (or True / False) force it.
    draft_quant "auto": an LM drafter on CPU drafts with int4 weights (eagle_fsd.quant) where that kernel
    measures faster; "int4" / "int8" / "off" force it. Verification keeps the target's weights: still lossless.
    target_quant "auto": a preset's target on CPU, loaded with dtype "auto", runs its linear layers int8 x int8,
    or int4 x int8 where its weights are 4-bit already (eagle_fsd.target_quant), where that measures faster;
    "int4" / "int8" / "off" force it. Decoding is then lossless against
    that quantized model, and the drafter is built for it (fp32 activations)."""
    check_backend(attention)
    resolve_draft_quant(draft_quant, None)  # a bad spelling fails before anything loads
    target_quant_choice(target_quant)
    fixed, auto = requested_tree(base_model in presets.PRESETS, tree)
    path = presets.resolve_model(base_model)
    kind, source = drafter_source(base_model, ea_model_path, draft_model)  # a bad head fails before the target loads
    config = AutoConfig.from_pretrained(path)
    run_dtype = resolve_dtype(dtype, device_map, config, prepack)  # "auto" resolved, anything else as given
    run_dtype = torch_dtype(run_dtype) if isinstance(run_dtype, str) else run_dtype
    target_bits = resolve_target_quant(target_quant, config, run_dtype, load_device(device_map),
                                       base_model in presets.PRESETS, dtype != "auto", prepack)
    # a target to be quantized loads as stored (its products are rounded from the checkpoint's own weights; a bf16
    # checkpoint then maps in a second where converting it to fp32 takes half a minute); quantize_target makes
    # every other parameter fp32
    target, tokenizer = load_target(path, "auto" if target_bits and dtype == "auto" else run_dtype, device_map,
                                    kwargs)
    if target_bits:
        quantize_cached(target, activation_bits=activation_bits(cpu_flags()), exact=True, four_bit=target_bits == 4,
                        requantize=False)
    drafter = build_drafter(kind, source, target, tokenizer, attention)
    prepare_weights(target, drafter, prepack, draft_quant)
    if drafter is None or not auto:
        shape = TreeShape(*(fixed.get(name, 1) for name in TREE_NAMES[:3]), fixed.get("draft_vocab", 0))
        return cls(target, tokenizer, drafter, shape=shape, attention=attention)
    provisional = TreeShape(*(fixed.get(name, 1) for name in TREE_NAMES[:3]))  # what is measured
    model = cls(target, tokenizer, drafter, shape=provisional, attention=attention)
    tuning = autotune(model, base_model, drafter_name=source, fixed=fixed, progress=tune_progress)
    return cls(target, tokenizer, drafter, shape=tuning.tree, attention=attention, tuning=tuning)


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


def prepare_weights(target, drafter, prepack, draft_quant) -> None:
    """Linear weights prepacked for oneDNN (target and drafter) and the drafter's rounded, where chosen. With a
    quantized target, an LM drafter on draft_quant "auto" runs the same kernels: where the target's run int4, every
    drafter layer is rounded to int4 (4-bit already or not: a drafter's rounding moves acceptance only, and half the
    bytes of int8 make each draft forward cheaper), else int8; its inputs are fp32 then."""
    if is_target_quantized(target) and draft_quant == "auto" and drafter is not None and drafter.auto_quant:
        four_bit = int4_share(target) > 0
        quantize_cached(drafter.module, activation_bits=activation_bits(cpu_flags()), exact=False, four_bit=four_bit,
                        requantize=four_bit)
        return
    if resolve_prepack(prepack, target):
        prepack_linears(target)
        if drafter is not None:
            prepack_linears(drafter.module)
    draft_bits = resolve_draft_quant(draft_quant, drafter)
    if draft_bits:
        quantize_linears(drafter.module, draft_bits)


def as_hf_runs_it(module):
    """`module` as a user of HF generate runs it: itself, or, where its linear layers were rounded to int8 here
    (eagle_fsd.target_quant), a fresh copy from the same folder in the dtype its config names (the baseline rows of
    `run` and `bench`)."""
    if module is None or not is_target_quantized(module):
        return module
    return AutoModelForCausalLM.from_pretrained(module.name_or_path, dtype="auto").eval()


# ---------------------------------------------------------------- the drafter
def holds_eagle_fc(path: str) -> bool:
    """A local directory whose weights hold EAGLE's `fc` layer (the feature/embedding fusion no causal LM has)."""
    folder = Path(path)
    if (folder / "model.safetensors").is_file():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            return "fc.weight" in f.keys()
    if (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=True)
        return "fc.weight" in state
    return False


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


def check_same_tokenizer(target_tok, draft_tok, draft_name):
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(f"draft model {draft_name!r} does not share the target's tokenizer "
                         f"({len(draft_tok)} vs {len(target_tok)} tokens, or different ids); an LM drafter must use "
                         "the same tokenizer as the target")


def build_drafter(kind: str | None, source, target, tokenizer, attention: str = "auto"):
    """The drafter of `kind` (drafter_source) for `target`: an EAGLE-3 or EAGLE-1/2 head from a directory or hub id,
    or an LM from a name (preset, directory or hub id) or a loaded model; None for no drafter."""
    if kind == "eagle3":
        head, layers = load_eagle3_head(source, target)
        return Eagle3Drafter(head, target, layers, attention)
    if kind == "eagle":
        return EagleDrafter(load_eagle_head(source, target), target, attention)
    if kind is None:
        return None
    if isinstance(source, str):
        draft_path = presets.resolve_model(source)
        check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(draft_path), source)
        source = AutoModelForCausalLM.from_pretrained(
            draft_path, dtype=target.dtype, attn_implementation=ATTENTION_NAME).to(target.device).eval()
    return LMDrafter(source, target.config.vocab_size, attention)


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
