"""Divergences between the target distribution p and the draft distribution q (FSD acceptance).

All functions are pure tensor code. Inputs are (..., V) unnormalised logits *or* log-probabilities of
any float dtype; ``log_softmax`` is applied internally in float32, so both forms give the same result.
The result has shape (...) and dtype float32. Natural log (nats) unless the name says bits.

Names (``DIVERGENCES``), with p = target, q = draft:

============  ==========================================  ============================================
name          quantity                                    notes
============  ==========================================  ============================================
``kl_qp``     KL(q‖p) = Σ q (ln q − ln p)                 FSD reference code's ``kl_div``
``kl_pq``     KL(p‖q) = Σ p (ln p − ln q)                 reference ``kl_div_reversed``; TRT-LLM
                                                          PR #12853 ``reverse_kl``
``jsd``       ½KL(p‖m) + ½KL(q‖m), m = (p+q)/2            true Jensen–Shannon, in [0, ln 2]
``jsd_bits``  jsd / ln 2                                  in [0, 1]
``tv``        ½ Σ |p − q|                                 in [0, 1]
``legacy_js`` ½KL(m‖p) + ½KL(m‖q), m = (p+q)/2            NOT Jensen–Shannon; paper-parity only
============  ==========================================  ============================================

``top_k=K`` coarse-grains both distributions onto K+1 bins before applying the formula: the target's
top-K tokens, plus one "rest" bucket per distribution holding that distribution's remaining mass
(1 − Σ top-K mass; computed as a logsumexp over the complement, so no cancellation and exactly 0 when
K ≥ V). q is read at p's top-K token ids; nothing is renormalised. This is the reference code's
``top_k_*_div`` (K = 50 there).

Numerics (defined behaviour, never an exception inside torch):

* Zero-probability tokens (−inf logits) are fine: every ``a·(ln a − ln b)`` term is 0 where a == 0
  (0·log0 = 0), so they never produce NaN.
* Where the quantity is mathematically infinite it is ``+inf``: KL(q‖p) when q > 0 where p == 0 (and
  KL(p‖q) symmetrically), ``legacy_js`` when the supports differ. ``jsd``/``jsd_bits``/``tv`` are always
  finite (disjoint supports give ln 2, 1, 1).
* A row whose log-softmax contains NaN gives NaN for that row only: a NaN logit, a +inf logit, or a
  row that is entirely −inf (no distribution at all), in either input. Callers treat NaN as "reject"
  (``NaN <= T`` is False).
* Rounding can make a divergence a few ulps negative or above its bound; results are clamped to the
  mathematical range ([0, ∞] for KL / legacy_js, [0, ln 2] for jsd, [0, 1] for jsd_bits and tv). NaN
  survives the clamp. Identical inputs give exactly 0 for every name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["DIVERGENCES", "DEFAULT_TOP_K", "divergence", "kl_qp_on_support", "align_vocab"]

DEFAULT_TOP_K = 50
_LN2 = math.log(2.0)


def _plogratio(a: Tensor, log_a: Tensor, log_b: Tensor) -> Tensor:
    """Σ_v a·(ln a − ln b) over the last dim (a KL-type sum), with the term defined as 0 where a == 0.

    The mask is ``a == 0`` (not ``a > 0``) so a NaN still propagates. Where a > 0 and ln b = −inf the term
    is +inf, as it should be.
    """
    terms = torch.where(a == 0, torch.zeros_like(a), a * (log_a - log_b))
    return terms.sum(dim=-1)


def _log_mixture(logp: Tensor, logq: Tensor) -> Tensor:
    # ln m = ln((p + q) / 2) = logaddexp(ln p, ln q) − ln 2; logaddexp(−inf, −inf) = −inf.
    # Where ln p == ln q, m = p exactly (avoids a rounding residue, so identical inputs give exactly 0).
    return torch.where(logp == logq, logp, torch.logaddexp(logp, logq) - _LN2)


def _kl_qp(logp: Tensor, logq: Tensor) -> Tensor:
    # KL(q‖p) = Σ q (ln q − ln p)
    return _plogratio(logq.exp(), logq, logp).clamp_min(0.0)


def _kl_pq(logp: Tensor, logq: Tensor) -> Tensor:
    # KL(p‖q) = Σ p (ln p − ln q)
    return _plogratio(logp.exp(), logp, logq).clamp_min(0.0)


def _jsd(logp: Tensor, logq: Tensor) -> Tensor:
    # JSD = ½ Σ p (ln p − ln m) + ½ Σ q (ln q − ln m),  m = (p + q)/2;  0 ≤ JSD ≤ ln 2
    logm = _log_mixture(logp, logq)
    js = 0.5 * _plogratio(logp.exp(), logp, logm) + 0.5 * _plogratio(logq.exp(), logq, logm)
    return js.clamp(0.0, _LN2)


def _jsd_bits(logp: Tensor, logq: Tensor) -> Tensor:
    # JSD / ln 2 ∈ [0, 1]
    return (_jsd(logp, logq) / _LN2).clamp(0.0, 1.0)


def _tv(logp: Tensor, logq: Tensor) -> Tensor:
    # TV = ½ Σ |p − q| ∈ [0, 1]
    return (0.5 * (logp.exp() - logq.exp()).abs().sum(dim=-1)).clamp(0.0, 1.0)


def _legacy_js(logp: Tensor, logq: Tensor) -> Tensor:
    """½KL(m‖p) + ½KL(m‖q), m = (p+q)/2: the FSD reference code's ``js_div``.

    This is NOT the Jensen–Shannon divergence (that is ½KL(p‖m) + ½KL(q‖m)): it is unbounded and +inf as
    soon as the supports differ, and it is ≥ ``jsd``. Kept only for paper-parity runs against the released
    ``maxholsman/fsd`` code; use ``jsd``/``jsd_bits`` otherwise. Unlike the reference (which yields NaN
    where p = q = 0) the 0·log0 terms are 0 here.
    """
    logm = _log_mixture(logp, logq)
    m = logm.exp()
    return (0.5 * _plogratio(m, logm, logp) + 0.5 * _plogratio(m, logm, logq)).clamp_min(0.0)


_DISPATCH: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "kl_qp": _kl_qp,
    "kl_pq": _kl_pq,
    "jsd": _jsd,
    "jsd_bits": _jsd_bits,
    "tv": _tv,
    "legacy_js": _legacy_js,
}

DIVERGENCES: tuple[str, ...] = tuple(_DISPATCH)


def _bucket_top_k(logp: Tensor, logq: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Coarse-grain (..., V) log-probs onto (..., k+1): p's top-k ids, then one "rest" bucket each.

    rest = ln(1 − Σ top-k mass), computed as logsumexp of the log-probs outside the top-k (−inf when
    k == V, i.e. an exactly empty rest bucket).
    """
    k = min(k, logp.shape[-1])
    idx = torch.topk(logp, k, dim=-1).indices
    neg_inf = torch.full_like(idx, float("-inf"), dtype=logp.dtype)

    def bucket(logx: Tensor) -> Tensor:
        top = logx.gather(-1, idx)
        rest = logx.scatter(-1, idx, neg_inf).logsumexp(dim=-1, keepdim=True)
        return torch.cat([top, rest], dim=-1)

    return bucket(logp), bucket(logq)


def _broadcast_pair(target_logits: Tensor, draft_logits: Tensor) -> tuple[Tensor, Tensor]:
    """The two inputs broadcast to one shape; ValueError for a missing, empty or mismatched vocab dim."""
    if target_logits.dim() == 0 or draft_logits.dim() == 0:
        raise ValueError("target_logits and draft_logits must have a vocab (last) dimension")
    v_t, v_d = target_logits.shape[-1], draft_logits.shape[-1]
    if v_t != v_d:
        raise ValueError(
            f"vocab size mismatch: target has {v_t} logits, draft has {v_d}; "
            "call align_vocab(target_logits, draft_logits, vocab_size) first"
        )
    if v_t == 0:
        raise ValueError("vocab dimension is empty (size 0)")
    try:
        return torch.broadcast_tensors(target_logits, draft_logits)
    except RuntimeError as e:
        raise ValueError(
            f"leading dims do not broadcast: target {tuple(target_logits.shape)}, "
            f"draft {tuple(draft_logits.shape)}"
        ) from e


def divergence(
    target_logits: Tensor,
    draft_logits: Tensor,
    name: str = "kl_qp",
    top_k: int | None = None,
) -> Tensor:
    """Divergence ``name`` between p = softmax(target_logits) and q = softmax(draft_logits).

    Args:
        target_logits: (..., V) target logits or log-probs, any float dtype.
        draft_logits: (..., V) draft logits or log-probs; leading dims must broadcast with the target's.
        name: one of ``DIVERGENCES`` (see the module docstring for the formulas).
        top_k: ``None`` for the full vocabulary; an int K ≥ 1 for the top-K variant (target's top-K tokens
            plus one rest bucket per distribution; K > V behaves as K = V). ``DEFAULT_TOP_K`` = 50 is the
            reference code's K.

    Returns:
        (...) float32 tensor; +inf where mathematically infinite, NaN for rows with NaN/+inf logits or
        an all −inf row (see the module docstring).

    Raises:
        ValueError: unknown ``name``, ``top_k`` < 1 (or not an int), mismatched or empty vocab dims,
            non-broadcastable leading dims. Use :func:`align_vocab` for padded-vocab model pairs.
    """
    fn = _DISPATCH.get(name)
    if fn is None:
        raise ValueError(f"unknown divergence {name!r}; valid names: {', '.join(DIVERGENCES)}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    target_logits, draft_logits = _broadcast_pair(target_logits, draft_logits)
    logp = torch.log_softmax(target_logits.float(), dim=-1)
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    # Rows with NaN after log_softmax (NaN / +inf logit, all −inf row) → NaN output for that row.
    bad = torch.isnan(logp).any(dim=-1) | torch.isnan(logq).any(dim=-1)

    if top_k is not None:
        logp, logq = _bucket_top_k(logp, logq, top_k)
    out = fn(logp, logq)
    return torch.where(bad, torch.full_like(out, float("nan")), out)


def kl_qp_on_support(target_logits: Tensor, draft_logits: Tensor, support: Tensor) -> Tensor:
    """KL(q‖p) for a draft distribution that lives on a subset S of the target's vocabulary.

    p = softmax(target_logits) over the whole (..., V) row; q = softmax(draft_logits) over the (..., |S|) columns,
    which are the target ids ``support`` (q is 0 on every other id). Because the terms of KL(q‖p) = Σ q (ln q − ln p)
    vanish where q = 0, it is Σ_{v∈S} q_v (ln q_v − x_v + ln Z_p), x the target logits and ln Z_p their logsumexp:
    one pass over the target row for Z_p, then |S| columns only. The same value as
    ``divergence(target, q scattered onto V with -inf elsewhere, "kl_qp")`` up to float32 rounding (summed in
    another order), with its edge cases: +inf where q > 0 on a token p excludes, NaN for a row with a NaN or +inf
    logit or no finite logit, in either input.
    """
    if support.dim() != 1 or support.numel() != draft_logits.shape[-1]:
        raise ValueError(f"support holds {support.numel()} ids for {draft_logits.shape[-1]} draft columns; pass the "
                         "target id of every draft column (a 1-D tensor)")
    target = target_logits.float()
    log_z = torch.logsumexp(target, dim=-1, keepdim=True)
    logp = target.index_select(-1, support) - log_z
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    out = _kl_qp(logp, logq)
    # log Z_p is finite exactly when the target row has a finite logit and no NaN or +inf one.
    bad = ~torch.isfinite(log_z[..., 0]) | torch.isnan(logq).any(dim=-1)
    return torch.where(bad, torch.full_like(out, float("nan")), out)


def align_vocab(target_logits: Tensor, draft_logits: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Slice both (..., V) tensors to the shared tokenizer vocab ``vocab_size``.

    Same-family model pairs often pad the LM head differently (e.g. Qwen2.5 151936 vs 152064). When both
    last dims are ≥ ``vocab_size`` the extra columns are padding and are dropped (views, no copy).
    Otherwise raises ValueError: the vocabularies differ and must be mapped explicitly.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    v_t, v_d = target_logits.shape[-1], draft_logits.shape[-1]
    if v_t < vocab_size or v_d < vocab_size:
        raise ValueError(
            f"cannot align vocabularies: target has {v_t} logits, draft has {v_d}, shared vocab_size="
            f"{vocab_size}; both must be >= vocab_size (padding only). Pass the shared tokenizer size "
            "(len(tokenizer)) as vocab_size, or map the draft vocabulary onto the target's (e.g. scatter a "
            "reduced draft vocab into the full vocab with -inf elsewhere)"
        )
    return target_logits[..., :vocab_size], draft_logits[..., :vocab_size]
