"""Fused divergences between two softmaxes, straight from the logits: a Triton kernel (full-vocabulary variants).

What it computes
----------------
``fused_divergence(target_logits, draft_logits, name)`` returns, for every row (tree node), the divergence ``name``
between p = softmax(target row) and q = softmax(draft row): the same quantity, numerics and edge cases as
:func:`eagle_fsd.divergence.divergence` with ``top_k=None`` (its module docstring defines them; names are
``eagle_fsd.divergence.DIVERGENCES``: kl_qp, kl_pq, jsd, jsd_bits, tv, legacy_js), without materialising any (N, V)
float32 intermediate. The top-k variants stay in torch (``divergence(..., top_k=K)``).

Shapes and layouts:
    target_logits, draft_logits: (..., V), same shape (leading dims may broadcast, as in the reference: an expanded
        2-D row costs nothing, stride 0). Any row stride and any vocab stride (unit vocab stride is the fast path).
        Dtypes float32 / float16 / bfloat16, may differ between the two inputs.
    returns: (...) float32, e.g. (N,) for (N, V) inputs.

Limits
------
* Full vocabulary only (no ``top_k``). V >= 1; V up to a few million (tested up to 3000 in the interpreter; designed for
  Qwen's 152k and Llama-3's 128k). Leading dims other than one (N, V) matrix are flattened (a copy only when the
  layout cannot be viewed as 2-D).
* Math is float32 throughout (loads are upcast right after ``tl.load``, which is also what makes bf16 correct under the
  interpreter). Agreement with the torch reference in the interpreter tests: <= ~1e-6 absolute, ~2e-7 relative on large
  values (the same V terms summed in another order; both are float32 and both sit ~5e-7 off the float64 value for
  nearly identical distributions). The tests allow rtol 1e-4 + atol 1e-5; gpu_check allows 5e-4 + 5e-5 on a GPU, where
  ``exp`` is the approximate ``ex2`` instruction.
* Edge cases as in the reference: -inf logits are zero-probability tokens (0 * log 0 = 0); +inf where the reference
  gives +inf (KL with disjoint support, legacy_js with different supports); jsd = ln 2 / tv = 1 for disjoint supports;
  a row with a NaN logit, a +inf logit, or only -inf logits (in either input) gives NaN for that row only; results are
  clamped to the mathematical range (NaN survives the clamp). Identical inputs give exactly 0 (both rows run through the
  same float operations, so ln p == ln q bit for bit and every term is 0).
* Devices: CUDA, or CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before this module is
  imported). Everything else raises; :func:`eagle_fsd.divergence.divergence` is the fallback there.
* Tested hardware: not yet timed on a GPU. Correctness is tested on CPU under the Triton interpreter (fp32, fp16, bf16
  via the upcast); the kernels are compiled (not run) for sm_90 in the tests (16-byte loads, no spills).
  ``python -m eagle_fsd.kernels.gpu_check`` runs a bf16 parity check and times the kernel against the torch reference
  on a GPU.

Design
------
Two passes over the vocabulary, both streaming in BLOCK_V tiles (no (N, V) temporaries):

* pass 1, online logsumexp of both rows at once: a scalar running max per row (one ``tl.max`` per tile) and a per-lane
  running sum of exp(x - max), rescaled when the max grows; one ``exp`` per element. -inf maxima are handled
  explicitly (no -inf - -inf), so an all -inf row ends with sum 0 and is flagged; a NaN or +inf logit makes the sum NaN
  and the row is flagged.
* pass 2, the reduction: per token ln p = (x_t - max_t) - ln Z_t, ln q likewise (torch's log_softmax formula), the
  reference's per-token term (``where(a == 0, 0, a * (ln a - ln b))`` etc.; for jsd / legacy_js ln m = ln((p + q)/2)
  = max(ln p, ln q) + ln(1 + exp(-|ln p - ln q|)) - ln 2, and ln m = ln p exactly where ln p == ln q), accumulated per
  lane and summed once at the end; then the clamp and the NaN flag.

Why two passes and not one pass with online rescaling: only the two KL's decompose
(KL(q||p) = sum q (x_d - x_t) / Z_d - lse_d + lse_t); jsd, tv and legacy_js need the normalised p and q of every token
(|p - q|, ln((p + q)/2)), so they need the normalisers first. Even for KL the single-pass form subtracts two large
numbers (lse_d - lse_t against sum q (x_d - x_t), both ~|logit| in size) and loses ~|logit| * 1e-7 absolute, where the
two-pass form keeps the reference's per-token accuracy. The second pass re-reads the rows; on a GPU they should mostly
still be in L2 (64 rows x 152k x 2 inputs x bf16 = 39 MB < 50 MB L2 on H100/H200), and every name uses the same passes.

Tiling and split-V (designed for an H100/H200; not yet timed):

* Every pass loops over full BLOCK_V tiles with unmasked loads (they compile to 16-byte vector loads) and finishes
  with one masked tail tile, so V need not be a multiple of anything.
* With one split, one program per row runs both passes and writes the result: one launch.
* With few rows (a 64-node tree gives 64 programs for 132 SMs), the vocabulary is cut into S chunks (multiples of
  BLOCK_V, >= 4 tiles each) so there are about 4 programs per SM: kernel 1 writes each chunk's (max, sum-exp) pair for
  both rows to a float32 workspace; kernel 2 (one program per row x chunk) merges the S pairs of its row into the
  row's normaliser and reduces its chunk into a partial sum; kernel 3 sums the S partials per row, clamps and flags NaN.
  Three launches, all deterministic (no atomics). ``num_splits`` forces S.
* GPU config: BLOCK_V = 2048, 8 warps (8 consecutive elements per thread per tile: 16-byte bf16 loads), fixed, not
  autotuned (a memory-bound streaming reduction; the alternatives are timed by gpu_check). Under the interpreter
  BLOCK_V = 1024 and one split unless forced. ``config={"BLOCK_V": ..., "num_warps": ...}`` overrides.
"""

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from eagle_fsd.divergence import DIVERGENCES

from .tree_attention import _next_pow2, kernel_available

__all__ = ["fused_divergence", "fused_divergence_available", "FUSED_DIVERGENCES"]

FUSED_DIVERGENCES = DIVERGENCES  # every full-vocabulary name of the reference
_LN2 = tl.constexpr(0.6931471805599453)
_NEG_INF = tl.constexpr(float("-inf"))
_NAN = tl.constexpr(float("nan"))


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _lse_step(m, l_vec, x):
    """Online logsumexp step: m is the scalar running max (-inf before any finite value), l_vec the per-lane sum of
    exp(x - m). Never evaluates -inf - -inf; a NaN or +inf x makes l_vec NaN (the row is then flagged)."""
    m_new = tl.maximum(m, tl.max(x, 0))
    m_safe = tl.where(m_new == _NEG_INF, 0.0, m_new)
    l_vec = l_vec * tl.exp(m - m_safe) + tl.exp(x - m_safe)
    return m_new, l_vec


@triton.jit
def _load_tile(ptr, stride, offs, ok, MASKED: tl.constexpr):
    """A BLOCK_V tile of one row as float32 (upcast right after the load; padding lanes -inf). Full tiles are loaded
    unmasked so they vectorise (16-byte loads); the tail tile is masked."""
    if MASKED:
        # other=0 then -inf in float32: an `other` of -inf cast to bf16 is wrong under the interpreter
        x = tl.where(ok, tl.load(ptr + offs * stride, mask=ok, other=0.0).to(tl.float32), _NEG_INF)
    else:
        x = tl.load(ptr + offs * stride).to(tl.float32)
    return x


@triton.jit
def _row_stats(t_ptr, d_ptr, stride_tv, stride_dv, n, BLOCK_V: tl.constexpr):
    """Pass 1 over n tokens of a target row and a draft row: (max_t, sumexp_t, max_d, sumexp_d)."""
    offs = tl.arange(0, BLOCK_V)
    m_t = tl.max(tl.full([BLOCK_V], _NEG_INF, tl.float32), 0)  # scalar -inf (a tensor: loop-carried)
    m_d = m_t
    l_t = tl.zeros([BLOCK_V], dtype=tl.float32)
    l_d = tl.zeros([BLOCK_V], dtype=tl.float32)
    n_full = n // BLOCK_V
    for _ in range(0, n_full):
        m_t, l_t = _lse_step(m_t, l_t, _load_tile(t_ptr, stride_tv, offs, offs, False))
        m_d, l_d = _lse_step(m_d, l_d, _load_tile(d_ptr, stride_dv, offs, offs, False))
        t_ptr += BLOCK_V * stride_tv
        d_ptr += BLOCK_V * stride_dv
    tail = n - n_full * BLOCK_V
    if tail > 0:
        ok = offs < tail
        m_t, l_t = _lse_step(m_t, l_t, _load_tile(t_ptr, stride_tv, offs, ok, True))
        m_d, l_d = _lse_step(m_d, l_d, _load_tile(d_ptr, stride_dv, offs, ok, True))
    return m_t, tl.sum(l_t, 0), m_d, tl.sum(l_d, 0)


@triton.jit
def _normaliser(m, l):
    """(shift, ln Z, ok) with ln softmax(x) = (x - shift) - ln Z; ok is False for a NaN sum (NaN / +inf logit) and for
    an empty one (all -inf row)."""
    ok = l > 0.0
    shift = tl.where(m == _NEG_INF, 0.0, m)
    logz = tl.log(tl.where(ok, l, 1.0))
    return shift, logz, ok


@triton.jit
def _terms(logp, logq, NAME: tl.constexpr):
    """Per-token summand (before the final 0.5 factor of jsd / tv / legacy_js), exactly the reference's terms."""
    if NAME == "kl_qp":
        q = tl.exp(logq)
        r = tl.where(q == 0.0, 0.0, q * (logq - logp))
    elif NAME == "kl_pq":
        p = tl.exp(logp)
        r = tl.where(p == 0.0, 0.0, p * (logp - logq))
    elif NAME == "tv":
        r = tl.abs(tl.exp(logp) - tl.exp(logq))
    else:
        # ln m = logaddexp(ln p, ln q) - ln 2, and exactly ln p where ln p == ln q (also covers -inf, -inf)
        hi = tl.maximum(logp, logq)
        logm = tl.where(logp == logq, logp, hi + tl.log(1.0 + tl.exp(-tl.abs(logp - logq))) - _LN2)
        if NAME == "legacy_js":
            mm = tl.exp(logm)
            r = tl.where(mm == 0.0, 0.0, mm * ((logm - logp) + (logm - logq)))
        else:  # jsd, jsd_bits
            p = tl.exp(logp)
            q = tl.exp(logq)
            r = tl.where(p == 0.0, 0.0, p * (logp - logm)) + tl.where(q == 0.0, 0.0, q * (logq - logm))
    return r


@triton.jit
def _tile_terms(t, d, shift_t, logz_t, shift_d, logz_d, NAME: tl.constexpr):
    logp = (t - shift_t) - logz_t
    logq = (d - shift_d) - logz_d
    return _terms(logp, logq, NAME)


@triton.jit
def _row_sum(t_ptr, d_ptr, stride_tv, stride_dv, n, shift_t, logz_t, shift_d, logz_d,
             NAME: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pass 2 over n tokens: sum of the per-token terms (padding lanes are -inf in both rows: every term is 0)."""
    offs = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    n_full = n // BLOCK_V
    for _ in range(0, n_full):
        t = _load_tile(t_ptr, stride_tv, offs, offs, False)
        d = _load_tile(d_ptr, stride_dv, offs, offs, False)
        acc += _tile_terms(t, d, shift_t, logz_t, shift_d, logz_d, NAME)
        t_ptr += BLOCK_V * stride_tv
        d_ptr += BLOCK_V * stride_dv
    tail = n - n_full * BLOCK_V
    if tail > 0:
        ok = offs < tail
        t = _load_tile(t_ptr, stride_tv, offs, ok, True)
        d = _load_tile(d_ptr, stride_dv, offs, ok, True)
        acc += _tile_terms(t, d, shift_t, logz_t, shift_d, logz_d, NAME)
    return tl.sum(acc, 0)


@triton.jit
def _finish(s, NAME: tl.constexpr):
    """Row sum -> divergence, clamped to its range with comparisons (tl.maximum/minimum may drop NaN on a GPU)."""
    if NAME == "tv":
        v = 0.5 * s
        v = tl.where(v < 0.0, 0.0, tl.where(v > 1.0, 1.0, v))
    elif NAME == "jsd" or NAME == "jsd_bits":
        v = 0.5 * s
        v = tl.where(v < 0.0, 0.0, tl.where(v > _LN2, _LN2, v))
        if NAME == "jsd_bits":
            v = v / _LN2
            v = tl.where(v > 1.0, 1.0, v)
    elif NAME == "legacy_js":
        v = 0.5 * s
        v = tl.where(v < 0.0, 0.0, v)
    else:  # kl_qp, kl_pq
        v = tl.where(s < 0.0, 0.0, s)
    return v


@triton.jit
def _div_fused_kernel(T, D, OUT, stride_t, stride_tv, stride_d, stride_dv, V,
                      NAME: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per row: both passes, then the result."""
    row = tl.program_id(0).to(tl.int64)
    t_ptr = T + row * stride_t
    d_ptr = D + row * stride_d
    m_t, l_t, m_d, l_d = _row_stats(t_ptr, d_ptr, stride_tv, stride_dv, V, BLOCK_V)
    shift_t, logz_t, ok_t = _normaliser(m_t, l_t)
    shift_d, logz_d, ok_d = _normaliser(m_d, l_d)
    s = _row_sum(t_ptr, d_ptr, stride_tv, stride_dv, V, shift_t, logz_t, shift_d, logz_d, NAME, BLOCK_V)
    v = tl.where(ok_t & ok_d, _finish(s, NAME), _NAN)
    tl.store(OUT + row, v)


@triton.jit
def _div_stats_kernel(T, D, WS, stride_t, stride_tv, stride_d, stride_dv, V, CHUNK, S, BLOCK_V: tl.constexpr):
    """Split pass 1: program (row, s) writes WS[row, s] = (max_t, sumexp_t, max_d, sumexp_d) of chunk s."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    lo = s * CHUNK
    n = tl.minimum(CHUNK, V - lo)
    t_ptr = T + row * stride_t + lo.to(tl.int64) * stride_tv
    d_ptr = D + row * stride_d + lo.to(tl.int64) * stride_dv
    m_t, l_t, m_d, l_d = _row_stats(t_ptr, d_ptr, stride_tv, stride_dv, n, BLOCK_V)
    w = WS + (row * S + s) * 4
    tl.store(w, m_t)
    tl.store(w + 1, l_t)
    tl.store(w + 2, m_d)
    tl.store(w + 3, l_d)


@triton.jit
def _merge_stats(m_s, l_s):
    """Merge per-chunk (max, sumexp) vectors (padding: -inf, 0) into one row's (shift, ln Z, ok)."""
    m = tl.max(m_s, 0)
    m_safe = tl.where(m == _NEG_INF, 0.0, m)
    l = tl.sum(l_s * tl.exp(m_s - m_safe), 0)  # a NaN chunk sum stays NaN (also when its max is +inf)
    return _normaliser(m, l)


@triton.jit
def _div_partial_kernel(T, D, WS, PART, stride_t, stride_tv, stride_d, stride_dv, V, CHUNK, S,
                        NAME: tl.constexpr, BLOCK_V: tl.constexpr, S_POW2: tl.constexpr):
    """Split pass 2: program (row, s) merges the row's S chunk stats and writes PART[row, s] = chunk s's term sum
    (NaN for a flagged row)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    idx = tl.arange(0, S_POW2)
    s_ok = idx < S
    w = WS + (row * S + idx) * 4
    shift_t, logz_t, ok_t = _merge_stats(tl.load(w, mask=s_ok, other=_NEG_INF), tl.load(w + 1, mask=s_ok, other=0.0))
    shift_d, logz_d, ok_d = _merge_stats(tl.load(w + 2, mask=s_ok, other=_NEG_INF),
                                         tl.load(w + 3, mask=s_ok, other=0.0))
    lo = s * CHUNK
    n = tl.minimum(CHUNK, V - lo)
    t_ptr = T + row * stride_t + lo.to(tl.int64) * stride_tv
    d_ptr = D + row * stride_d + lo.to(tl.int64) * stride_dv
    part = _row_sum(t_ptr, d_ptr, stride_tv, stride_dv, n, shift_t, logz_t, shift_d, logz_d, NAME, BLOCK_V)
    tl.store(PART + row * S + s, tl.where(ok_t & ok_d, part, _NAN))


@triton.jit
def _div_combine_kernel(PART, OUT, N, S, NAME: tl.constexpr, BLOCK_R: tl.constexpr, S_POW2: tl.constexpr):
    """Split epilogue: OUT[row] = finish(sum_s PART[row, s]); a NaN partial makes the row NaN."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < N
    idx = tl.arange(0, S_POW2)
    x = tl.load(PART + rows[:, None].to(tl.int64) * S + idx[None, :], mask=r_ok[:, None] & (idx < S)[None, :],
                other=0.0)
    tl.store(OUT + rows, _finish(tl.sum(x, 1), NAME), mask=r_ok)


_INTERPRETING = type(_div_fused_kernel).__name__ == "InterpretedFunction"

_GPU_CONFIG = {"BLOCK_V": 2048, "num_warps": 8}
_INTERP_CONFIG = {"BLOCK_V": 1024, "num_warps": 4}
_MIN_TILES_PER_SPLIT = 4  # a split chunk is at least this many BLOCK_V tiles
_PROGRAMS_PER_SM = 4
_MAX_SPLITS = 64
_BLOCK_R = 16
last_launch = None  # (splits, config) of the latest call; for gpu_check / debugging


# ----------------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------------


def fused_divergence_available(device) -> bool:
    """Whether :func:`fused_divergence` can run on ``device``: CUDA, or CPU under the Triton interpreter."""
    return kernel_available(device)


_SM_COUNT = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _split_plan(rows: int, vocab: int, block_v: int, num_sms: int, num_splits: Optional[int]):
    """(splits, chunk): about _PROGRAMS_PER_SM programs per SM, chunks of >= _MIN_TILES_PER_SPLIT tiles (a multiple of
    block_v), at most _MAX_SPLITS; every split gets >= 1 token. ``num_splits`` forces the count (clamped to the
    number of tiles)."""
    tiles = -(-vocab // block_v)
    if num_splits is None:
        target = _PROGRAMS_PER_SM * num_sms
        num_splits = min(_MAX_SPLITS, -(-target // max(rows, 1)), -(-tiles // _MIN_TILES_PER_SPLIT))
    num_splits = max(1, min(int(num_splits), tiles))
    chunk = -(-tiles // num_splits) * block_v
    return -(-vocab // chunk), chunk


def _check(target_logits, draft_logits, name):
    if name not in DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; valid names: {', '.join(DIVERGENCES)}")
    for what, t in (("target_logits", target_logits), ("draft_logits", draft_logits)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{what} must have a vocab (last) dimension, got a 0-d tensor")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{what} has unsupported dtype {t.dtype}; use float32, float16 or bfloat16")
    v_t, v_d = target_logits.shape[-1], draft_logits.shape[-1]
    if v_t != v_d:
        raise ValueError(f"shape mismatch: target has {v_t} logits per row, draft has {v_d}; "
                         "call eagle_fsd.divergence.align_vocab(target_logits, draft_logits, vocab_size) first")
    if v_t == 0:
        raise ValueError("vocab dimension is empty (size 0)")
    if target_logits.device != draft_logits.device:
        raise ValueError(f"device mismatch: target on {target_logits.device}, draft on {draft_logits.device}")
    try:
        return torch.broadcast_tensors(target_logits, draft_logits)
    except RuntimeError as e:
        raise ValueError(f"shape mismatch: leading dims do not broadcast: target {tuple(target_logits.shape)}, "
                         f"draft {tuple(draft_logits.shape)}") from e


def _as_2d(x: torch.Tensor, vocab: int) -> torch.Tensor:
    if x.dim() == 2:
        return x
    if x.dim() == 1:
        return x.unsqueeze(0)
    return x.reshape(-1, vocab)  # a view when the layout allows it, else a copy


def fused_divergence(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    name: str = "kl_qp",
    *,
    out: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """Divergence ``name`` between p = softmax(target_logits) and q = softmax(draft_logits), per row, in one fused
    streaming pass pair (see the module docstring). Same results as ``eagle_fsd.divergence.divergence(target_logits,
    draft_logits, name)`` within float32 rounding.

    Args:
        target_logits: (..., V) target logits or log-probs, float32 / float16 / bfloat16, any strides.
        draft_logits: (..., V) draft logits, same V; leading dims broadcast with the target's.
        name: one of ``eagle_fsd.divergence.DIVERGENCES`` (kl_qp, kl_pq, jsd, jsd_bits, tv, legacy_js).
        out: optional preallocated contiguous float32 output of the broadcast leading shape (written completely).
        num_splits: force the number of vocabulary chunks per row (default: heuristic; 1 = one program per row).
        config: force {"BLOCK_V": power of two >= 16, "num_warps": int}.

    Returns:
        (...) float32: +inf where mathematically infinite, NaN for rows with a NaN / +inf logit or only -inf logits.

    Raises:
        ValueError: unknown ``name``, mismatched vocab / non-broadcastable shapes, empty vocab, device mismatch, bad
            ``out`` / ``config``.
        TypeError: non-tensor input or an unsupported dtype.
        RuntimeError: the device cannot run the kernel (CPU without ``TRITON_INTERPRET=1`` at import, or no CUDA);
            use ``eagle_fsd.divergence.divergence`` there.
    """
    target_logits, draft_logits = _check(target_logits, draft_logits, name)
    device = target_logits.device
    if not fused_divergence_available(device):
        why = "TRITON_INTERPRET=1 was not set before import" if device.type == "cpu" else "no CUDA kernel"
        raise RuntimeError(f"fused_divergence's Triton kernel cannot run on {device} ({why}); "
                           "use eagle_fsd.divergence.divergence there")
    lead = tuple(target_logits.shape[:-1])
    vocab = target_logits.shape[-1]
    if out is None:
        out = torch.empty(lead, device=device, dtype=torch.float32)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != lead or out.dtype != torch.float32
          or out.device != device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 tensor of shape {lead} on {device}")
    t2, d2 = _as_2d(target_logits, vocab), _as_2d(draft_logits, vocab)
    rows = t2.shape[0]
    cfg = dict(config or (_INTERP_CONFIG if _INTERPRETING else _GPU_CONFIG))
    block_v = int(cfg.get("BLOCK_V", 0))
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"config BLOCK_V must be a power of two >= 16, got {cfg.get('BLOCK_V')!r}")
    num_warps = int(cfg.get("num_warps", 4))
    if num_splits is None and _INTERPRETING:
        num_splits = 1  # no parallelism to gain on the CPU interpreter
    splits, chunk = _split_plan(rows, vocab, block_v, _num_sms(device), num_splits)
    global last_launch
    last_launch = (splits, {"BLOCK_V": block_v, "num_warps": num_warps})
    if rows == 0:
        return out
    strides = (t2.stride(0), t2.stride(1), d2.stride(0), d2.stride(1))
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if splits == 1:
            _div_fused_kernel[(rows,)](t2, d2, out, *strides, vocab, NAME=name, BLOCK_V=block_v,
                                       num_warps=num_warps)
        else:
            s_pow2 = max(16, _next_pow2(splits))
            ws = torch.empty((rows, splits, 4), device=device, dtype=torch.float32)
            part = torch.empty((rows, splits), device=device, dtype=torch.float32)
            _div_stats_kernel[(rows, splits)](t2, d2, ws, *strides, vocab, chunk, splits, BLOCK_V=block_v,
                                              num_warps=num_warps)
            _div_partial_kernel[(rows, splits)](t2, d2, ws, part, *strides, vocab, chunk, splits, NAME=name,
                                                BLOCK_V=block_v, S_POW2=s_pow2, num_warps=num_warps)
            _div_combine_kernel[(triton.cdiv(rows, _BLOCK_R),)](part, out, rows, splits, NAME=name,
                                                                BLOCK_R=_BLOCK_R, S_POW2=s_pow2, num_warps=4)
    return out
