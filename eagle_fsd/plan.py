"""The run plan: how a model runs, decided once by the loader (and the tuner's tree choice) and read everywhere.

    WeightFormat   how one model's linear layers store and multiply their weights (eagle_fsd.weights applies it)
    ModelRun       how one model (target or drafter) runs: dtype, weight format, fused decoder, attention backend,
                   float64 attention and the KV cache's dtype that follows from them
    RunPlan        the target's and the drafter's ModelRun, the draft vocabulary and the draft tree per acceptance
                   rule; its `key()` names the cost profile measured for it, `summary()` is the CLI's line

Nothing is written onto Hugging Face configs or modules: the engine, the cache, the attention function, the CLI and
the cost-profile key take their answers from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from eagle_fsd.dtypes import dtype_name
from eagle_fsd.fsd import FsdConfig
from eagle_fsd.kernels.int4_rows import GROUP
from eagle_fsd.tree.shape import TreeShape

WEIGHT_KINDS = ("float", "prepacked", "int8", "int4", "rows")


@dataclass(frozen=True)
class WeightFormat:
    """How a model's linear layers multiply.
    float      as loaded (F.linear)
    prepacked  the weight packed once for oneDNN (eagle_fsd.prepack)
    int8/int4  weight-only rounding, activations in the model's dtype (a drafter: eagle_fsd.quant)
    rows       int8 x int8 with activations rounded to `activation_bits` (eagle_fsd.target_quant); `four_bit`: the
               layers that are 4-bit already run int4 x int8 (with `requantize`, every layer of whole groups);
               `exact`: activations rounded row by row (a target), else once per call (a drafter); `gguf`: a GGUF
               file whose Q4_K / Q6_K blocks the layers it holds run on as they are (eagle_fsd.gguf_blocks);
               `int4_group`: inputs per 4-bit scale where they divide a row (else 32; a drafter's may be coarser)"""

    kind: str = "float"
    activation_bits: int | None = None  # None: this CPU's (eagle_fsd.target_quant.cpu_activation_bits)
    four_bit: bool = False
    requantize: bool = False
    exact: bool = True
    gguf: str | None = None
    int4_group: int = GROUP

    def __post_init__(self):
        if self.kind not in WEIGHT_KINDS:
            raise ValueError(f"weight format {self.kind!r}: use one of {WEIGHT_KINDS}")

    @property
    def quantized_rows(self) -> bool:
        return self.kind == "rows"


@dataclass(frozen=True)
class ModelRun:
    """How one model runs. exact: a target (its tokens are the reference) rather than a drafter (whose rounding only
    moves acceptance). fused: eagle_fsd.fused_decoder runs its forwards. int4_share / int8_rows: what the weight step
    made of a `rows` model (the share of weights run 4-bit; int8 layers on eagle_fsd.kernels.int8_rows); gguf_share: the
    share run on a GGUF's own blocks."""

    dtype: torch.dtype = torch.float32
    weights: WeightFormat = field(default_factory=WeightFormat)
    fused: bool = False
    exact: bool = True
    backend: str = "auto"
    int4_share: float = 0.0
    int8_rows: bool = False
    gguf_share: float = 0.0

    @property
    def fp64_attention(self) -> bool:
        """An exact model with row-rounded activations attends in float64 where transformers' layers attend: the same
        value for a query whatever else the forward holds (eagle_fsd.target_quant)."""
        return self.exact and self.weights.quantized_rows and self.weights.exact

    @property
    def rows_attend(self) -> bool:
        """A fused forward on top of a cached prefix attends in C++, each query over its visible keys in a fixed order:
        a drafter's always, a target's where its activations are row-rounded (a float target keeps SDPA, whose bits
        equal transformers' forward)."""
        return self.fused and (not self.exact or self.fp64_attention)

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """The KV cache's storage dtype: float64 where transformers' layers attend in float64 (each key widened once
        when stored, exactly), else as the keys arrive (None)."""
        return torch.float64 if self.fp64_attention and not self.fused else None

    def label(self) -> str:
        """How the linear layers multiply, in words."""
        kind = self.weights.kind
        if kind == "rows":
            if self.gguf_share:
                return f"GGUF Q4_K / Q6_K blocks x int8 ({self.gguf_share:.0%} of weights, {self.int4_share:.0%} 4-bit)"
            group = f", groups of {self.weights.int4_group}" if self.weights.int4_group != GROUP else ""
            share = f"int4 x int8 ({self.int4_share:.0%} of weights{group}), " if self.int4_share else ""
            return f"{share}int8 x int8"
        return {"float": "as loaded", "prepacked": "as loaded, prepacked"}.get(kind, kind)

    def key(self) -> dict:
        """What makes this model time differently (a part of the cost-profile key)."""
        key = {"dtype": dtype_name(self.dtype)}
        if self.weights.kind != "float":
            key["weights"] = self.weights.kind
        if self.weights.kind == "rows":
            key["int4_share"] = round(self.int4_share, 2)
            key["int8_kernel"] = "int8_rows" if self.int8_rows else "fbgemm"
            if self.gguf_share:
                key["gguf_share"] = round(self.gguf_share, 2)
            if self.int4_share and self.weights.int4_group != GROUP:
                key["int4_group"] = self.weights.int4_group
        if self.fused:
            key["fused"] = True
        return key


Rule = FsdConfig | None  # an acceptance rule: None is lossless


def rule_key(rule: Rule) -> Rule:
    """The rule a tree is kept under: lossless for None or a threshold of None."""
    return None if rule is None or rule.threshold is None else rule


@dataclass(frozen=True)
class RunPlan:
    """How a model runs. trees: (rule, TreeShape) pairs, the lossless rule (None) first; a rule without its own tree
    runs the lossless one. tuned: the cost model chose the tree (the speed guard needs its measured costs)."""

    target: ModelRun
    drafter: ModelRun | None = None
    trees: tuple[tuple[Rule, TreeShape], ...] = ((None, TreeShape(60, 5, 10)),)
    tuned: bool = False

    @property
    def tree(self) -> TreeShape:
        """The lossless rule's tree: the model's own."""
        return self.trees[0][1]

    @property
    def draft_vocab(self) -> int:
        return self.tree.draft_vocab

    def tree_for(self, rule: Rule) -> TreeShape:
        return dict(self.trees).get(rule_key(rule), self.tree)

    def with_tree(self, shape: TreeShape, rule: Rule = None, tuned: bool | None = None) -> RunPlan:
        """This plan with `shape` as the tree of `rule`."""
        trees = dict(self.trees)
        trees[rule_key(rule)] = shape
        ordered = ((None, trees.pop(None)), *trees.items())
        return replace(self, trees=ordered, tuned=self.tuned if tuned is None else tuned)

    def key(self) -> dict:
        """The plan's part of the cost-profile key: what changes the timings (not the tree, which they choose)."""
        key = {"target": self.target.key()}
        if self.drafter is not None:
            key["drafter"] = self.drafter.key()
        return key

    def to_json(self) -> dict:
        """The plan as saved beside the cost profile measured for it."""
        trees = [{"rule": None if rule is None else repr(rule), "tree": list(shape.eagle()),
                  "draft_vocab": shape.draft_vocab} for rule, shape in self.trees]
        return {**self.key(), "trees": trees, "tuned": self.tuned}

    def summary(self) -> str:
        drafter = "none" if self.drafter is None else self.drafter.label()
        return (f"target {dtype_name(self.target.dtype)}, weights {self.target.label()}"
                f"{', fused decoder' if self.target.fused else ''}; drafter weights {drafter}"
                f"{', fused decoder' if self.drafter is not None and self.drafter.fused else ''}; tree "
                f"{self.tree.eagle()}, draft vocabulary {self.draft_vocab or 'full'}")
