"""Typed settings of a run, and the one set of CLI flags they come from.

Every command that loads a model (run, chat, mtbench, bench, sweep) defines its model / tree / sampling / FSD flags
with add_model_args and add_fsd_args (one definition, one set of defaults: EAGLE's flag names where it has one) and
turns the parsed flags into these dataclasses with `from_args`, the only code that reads an argparse Namespace.
Library code (loading.load_model, prompts.generate_reply, the harness functions, ChatSession) takes the dataclasses.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from eagle_fsd.attention import BACKENDS
from eagle_fsd.dtypes import DTYPES
from eagle_fsd.fsd import DIVERGENCES, FSD_MODES, FsdConfig

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DTYPE_NAMES = (*sorted(DTYPES), "auto")
ATTENTION_NAMES = BACKENDS
AUTO = "auto"  # a tree setting the measured cost model chooses (eagle_fsd.tune)


def check_model_dir(flag: str, value) -> None:
    """A model or head named by a local directory must hold its config.json: said before anything loads (a
    preset name or hub id is checked where it is resolved)."""
    if isinstance(value, str) and Path(value).is_dir() and not (Path(value) / "config.json").is_file():
        raise ValueError(f"{flag} {value}: the directory has no config.json; give a Hugging Face model folder (or, "
                         "for an EAGLE head, its folder with config.json and model.safetensors / pytorch_model.bin)")


@dataclass(frozen=True)
class ModelSettings:
    """What to load. drafter: an LM sharing the tokenizer or an EAGLE head directory (None: the preset's own);
    ea_model_path: an EAGLE-1/2 or EAGLE-3 head; conv_template: a FastChat template for models without a chat template;
    threads: torch CPU threads (None: torch's choice); device: from_pretrained's device_map (None: its default);
    prepack: "auto", "on" or "off" (eagle_fsd.prepack: CPU fp32 / bf16 linear weights packed once for oneDNN);
    draft_quant: "auto", "int4", "int8" or "off" (eagle_fsd.quant: the drafter's weights rounded, CPU);
    target_quant: "auto", "int4", "int8" or "off" (eagle_fsd.target_quant: the target's linear layers int8 x int8, or
        int4 x int8 where the weights are 4-bit already, CPU)."""

    model: str = DEFAULT_MODEL
    drafter: str | None = None
    ea_model_path: str | None = None
    dtype: str = "auto"
    attention: str = "auto"
    conv_template: str | None = None
    threads: int | None = None
    device: str | None = None
    prepack: str = "auto"
    draft_quant: str = "auto"
    target_quant: str = "auto"

    def __post_init__(self):
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads <= 0):
            raise ValueError(f"threads={self.threads!r} must be a positive int (default: torch's choice)")
        for flag, value in (("--model", self.model), ("--drafter", self.drafter), ("--ea-model-path",
                                                                                  self.ea_model_path)):
            check_model_dir(flag, value)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelSettings:
        return cls(args.model, args.drafter, args.ea_model_path, args.dtype, args.attention, args.conv_template,
                   args.threads, prepack=args.prepack, draft_quant=args.draft_quant,
                   target_quant=args.target_quant)


@dataclass(frozen=True)
class TreeSettings:
    """The draft tree: total_token nodes incl. the root, depth draft forwards, top_k branching (EAGLE's names);
    each a positive int or "auto". draft_vocab: the drafter scores the N most frequent tokens (0: all), "auto", or
    None: "auto" while any other setting is, else 0."""

    total_token: int | str = AUTO
    depth: int | str = AUTO
    top_k: int | str = AUTO
    draft_vocab: int | str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TreeSettings:
        return cls(args.total_token, args.depth, args.top_k, args.draft_vocab)

    def as_list(self) -> list:
        return [self.total_token, self.depth, self.top_k, self.draft_vocab]


@dataclass(frozen=True)
class GenerationSettings:
    """Sampling (temperature 0 = greedy; top_k 0 = off) and the method: baseline = plain decoding, the target
    alone, one token per forward."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    baseline: bool = False

    def __post_init__(self):
        n, t, p = self.max_new_tokens, self.temperature, self.top_p
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"max_new_tokens={n!r} must be a positive int (e.g. --max-new-tokens 128)")
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature={t!r} must be a number >= 0 (0 = greedy)")
        if not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise ValueError(f"top_p={p!r} must be in (0, 1] (1 = off)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GenerationSettings:
        return cls(args.max_new_token, args.temperature, args.top_p, baseline=args.baseline)

    def sampling_kwargs(self) -> dict:
        """The keywords EaFsdModel.generate and naive_generate share."""
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k)


def fsd_from_args(args: argparse.Namespace) -> FsdConfig:
    """FsdConfig from the FSD flags; ValueError names a bad value."""
    return FsdConfig(args.fsd_threshold, args.fsd_divergence, args.fsd_mode, exact_prefix=args.fsd_exact_prefix,
                     keep_stop=args.fsd_keep_stop, top_r=args.fsd_top_r, margin=args.fsd_margin,
                     min_entropy=args.fsd_min_entropy)


@dataclass(frozen=True)
class Settings:
    """Everything a model-loading command shares."""

    model: ModelSettings = ModelSettings()
    tree: TreeSettings = TreeSettings()
    generation: GenerationSettings = GenerationSettings()
    fsd: FsdConfig = FsdConfig()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        return cls(ModelSettings.from_args(args), TreeSettings.from_args(args), GenerationSettings.from_args(args),
                   fsd_from_args(args))


# ---------------------------------------------------------------- flags
def add_model_args(p: argparse.ArgumentParser, max_new_flag: tuple[str, ...] = ("--max-new-token", "--max-new-tokens"),
                   max_new_default: int = 1024, baseline_flag: bool = True) -> None:
    """The model / drafter / tree / sampling flags (EAGLE's names where it has one). A command without
    --baseline gets False; --threads (add_threads_arg) is offered where timing needs it, else None."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name, hub id or directory")
    p.add_argument("--drafter", default=None,
                   help="LM drafter sharing the tokenizer (preset, dir or hub id) or an EAGLE head directory; "
                        "default: the preset's drafter")
    p.add_argument("--ea-model-path", default=None, help="EAGLE-1/2 or EAGLE-3 head (dir or hub id)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="auto",
                   help="auto: bf16 on CUDA; on CPU bf16 only with native bf16 matmul that measures faster, else fp32")
    p.add_argument("--attention", choices=list(ATTENTION_NAMES), default="auto")
    add_kernel_args(p)
    p.add_argument("--total-token", type=tree_arg, default=AUTO,
                   help="tree nodes incl. root, or auto (default): chosen by the measured cost model (eagle-fsd tune)")
    p.add_argument("--depth", type=tree_arg, default=AUTO, help="draft forwards per step, or auto")
    p.add_argument("--top-k", type=tree_arg, default=AUTO,
                   help="draft tree branching (EAGLE's --top-k), not sampling; or auto")
    p.add_argument("--draft-vocab", type=vocab_arg, default=None,
                   help="the drafter scores only the N most frequent tokens (0: all of them), or auto; default: auto "
                        "when the tree is auto, else 0. Give all four tree settings to pin the tree")
    p.add_argument(*max_new_flag, dest="max_new_token", type=int, default=max_new_default)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--conv-template", default=None,
                   help="FastChat conversation template (e.g. vicuna_v1.1) for models without a chat template")
    if baseline_flag:
        p.add_argument("--baseline", action="store_true", help="plain decoding with the target alone (naive_generate)")
    else:
        p.set_defaults(baseline=False)
    p.set_defaults(threads=None)


def add_kernel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prepack", choices=("auto", "on", "off"), default="auto",
                   help="CPU fp32 / bf16: linear weights packed once for oneDNN; auto: where it measures faster")
    p.add_argument("--draft-quant", choices=("auto", "int4", "int8", "off"), default="auto",
                   help="CPU: the drafter's weights in int4 / int8 (verification keeps the target's: lossless); "
                        "auto: int4 for an LM drafter where it measures faster")
    p.add_argument("--target-quant", choices=("auto", "int4", "int8", "off"), default="auto",
                   help="CPU: the target's linear layers in int8 (int4: 4-bit where the preset's weights are "
                        "4-bit already; AVX-512 VNNI or AVX2) with 8-bit activations per row; decoding is then lossless "
                        "against that model. auto: for a preset loaded with --dtype auto, the kernel that measures "
                        "fastest")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def add_fsd_args(p: argparse.ArgumentParser, threshold_flag: bool = True, divergence_flag: bool = True) -> None:
    """The FSD flags; a command without --fsd-threshold (or --fsd-divergence) gets the default (None: lossless)."""
    if threshold_flag:
        p.add_argument("--fsd-threshold", type=float, default=None, help="FSD threshold T (default: lossless)")
    else:
        p.set_defaults(fsd_threshold=None)
    if divergence_flag:
        p.add_argument("--fsd-divergence", default="kl_qp", help=f"one of {', '.join(DIVERGENCES)}")
    else:
        p.set_defaults(fsd_divergence="kl_qp")
    p.add_argument("--fsd-mode", default="reducible", choices=list(FSD_MODES))
    p.add_argument("--fsd-exact-prefix", type=int, default=0, metavar="L",
                   help="verify the first L new tokens of a reply losslessly, FSD after them (default 0)")
    p.add_argument("--fsd-keep-stop", action="store_true",
                   help="guard: no fuzzy acceptance where the target's own choice is a stop token")
    p.add_argument("--fsd-top-r", type=int, default=None, metavar="R",
                   help="guard: a fuzzy acceptance only for a draft within the target's top R tokens")
    p.add_argument("--fsd-margin", type=float, default=None, metavar="NATS",
                   help="guard: a fuzzy acceptance only for a draft within NATS of the target's best log-probability")
    p.add_argument("--fsd-min-entropy", type=float, default=None, metavar="NATS",
                   help="guard: fuzzy acceptance only where the target's entropy exceeds NATS")


def int_or_auto(text: str, minimum: int, expected: str):
    """An int >= minimum or "auto"; otherwise a usage error saying what was `expected`."""
    if text == AUTO:
        return text
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} is not {expected}")
    return value


def tree_arg(text: str):
    """A tree setting: a positive int (EAGLE's meaning) or "auto" (the cost model's choice)."""
    return int_or_auto(text, 1, "a positive int or 'auto' (EAGLE's GPU defaults: total_token 60, depth 5, top_k 10)")


def vocab_arg(text: str):
    """A draft vocabulary size: an int >= 0 (0: the full vocabulary) or "auto"."""
    return int_or_auto(text, 0, "a draft vocabulary size (an int >= 0; 0 = the full vocabulary) or 'auto'")


def parse_settings(p: argparse.ArgumentParser, args: argparse.Namespace) -> Settings:
    """Settings from parsed flags; a bad value (e.g. an FSD threshold < 0) is a usage error at once, not after
    minutes of loading."""
    try:
        return Settings.from_args(args)
    except ValueError as err:
        p.error(str(err))
