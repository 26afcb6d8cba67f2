"""Fuzzy Speculative Decoding settings and the per-node divergences it thresholds."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eagle_fsd.divergence import DIVERGENCES, align_vocab, divergence
from eagle_fsd.tree.accept import FSD_MODES
from eagle_fsd.tree.dynamic import DraftTree

DISTRIBUTIONS = ("raw", "processed")


@dataclass(frozen=True)
class FsdConfig:
    """threshold: T (None = FSD off, lossless). divergence: one of DIVERGENCES (natural log; jsd_bits in [0, 1]).
    mode: "reducible" (lossless rule first, T = 0 is exact) or "original" (the paper's code: D <= T accepts).
    T = math.inf: reducible accepts the top-ranked child wherever the lossless rule rejects every child, original
    accepts it at every node; any D counts there, +inf included (a reduced draft vocabulary, processed distributions),
    except NaN (no divergence computed), which never accepts.
    distributions: "raw" (temperature 1, full vocabulary; the paper's setting) or "processed" (after temperature /
    top-k / top-p). top_k: the divergence over the target's top-K tokens plus one rest bucket (None = full vocab)."""

    threshold: float | None = None
    divergence: str = "kl_qp"
    mode: str = "reducible"
    distributions: str = "raw"
    top_k: int | None = None

    def __post_init__(self):
        t = self.threshold
        if t is not None and (not isinstance(t, (int, float)) or math.isnan(t) or t < 0):
            raise ValueError(f"fsd_threshold={t!r} must be a number >= 0 (None turns FSD off; 0 with the reducible "
                             "mode is lossless; math.inf accepts the top-ranked child wherever the mode allows, "
                             "whatever D is)")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"fsd_divergence={self.divergence!r} is not one of {DIVERGENCES}")
        if self.mode not in FSD_MODES:
            raise ValueError(f"fsd_mode={self.mode!r} is not one of {FSD_MODES}")
        if self.distributions not in DISTRIBUTIONS:
            raise ValueError(f"fsd_distributions={self.distributions!r} is not one of {DISTRIBUTIONS}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"fsd_top_k={self.top_k!r} must be a positive int or None (full vocabulary)")

    @property
    def active(self) -> bool:
        return self.threshold is not None


def node_divergences(tree: DraftTree, target_logits: torch.Tensor, fsd: FsdConfig, vocab_size: int,
                     processor=None) -> torch.Tensor:
    """(n,) D_n = Div(p_n, q_n) for every expanded node, NaN for the others (never accepted fuzzily).

    Both distributions are cut to the tokenizer's `vocab_size`: logit rows padded beyond it are not tokens. With a
    reduced draft vocabulary q is 0 outside it, so KL(p||q) (kl_pq) and legacy_js are +inf wherever p has mass
    there (no fuzzy accept at a finite T; T = inf accepts any D but NaN); kl_qp, jsd and tv stay finite."""
    draft = tree.draft_logprobs_over(target_logits.shape[-1])[tree.dist_index.clamp(min=0)]
    target, draft = align_vocab(target_logits.float(), draft, vocab_size)
    if fsd.distributions == "processed" and processor is not None:
        target, draft = processor(None, target), processor(None, draft.clone())
    if fsd.top_k is None and target.is_cuda:
        from eagle_fsd.kernels import fused_divergence

        div = fused_divergence(target, draft, fsd.divergence)
    else:
        div = divergence(target, draft, fsd.divergence, top_k=fsd.top_k)
    return torch.where(tree.dist_index >= 0, div, float("nan"))
