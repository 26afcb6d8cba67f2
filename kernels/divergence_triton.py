"""The Triton kernels of :func:`fused_divergence` (host side and API: divergence.py).

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

import triton
import triton.language as tl

_LN2 = tl.constexpr(0.6931471805599453)
_NEG_INF = tl.constexpr(float("-inf"))
_NAN = tl.constexpr(float("nan"))


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
