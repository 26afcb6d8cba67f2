"""The Triton kernels of :func:`tree_attention` (host side and API: tree_attention.py).

Tiling (designed for an H100/H200; not yet timed)
-------------------------------------------------
* One program handles BLOCK_M rows of the packed "query x GQA-group" dimension for one (batch, kv head): row
  ``m = i * G + g`` is tree query i of query head ``hkv * G + g``. All G heads that share a KV head share each K/V tile
  load, so a decode-style problem with N <= 64 queries still gives MMA-sized M tiles (N=16, G=4 -> M=64), and the output
  rows of one tile are contiguous in the (B, N, Hq, D) output.
* Phase 1 streams the prefix K/V in BLOCK_N tiles with no mask work at all (full tiles unmasked, pipelined by the
  compiler; one boundary-masked tail tile). Phase 2 covers the N tree keys in tiles of 32 keys: each row loads one int32
  word per tile, the tile is skipped when no row of the block sees any of its keys, else the bits are expanded with a
  shift + and and applied as -inf.
* Loads are vectorised because head_dim has unit stride; the prefix loop compiles to cp.async pipelining and wgmma on
  sm_90 (checked by compiling for sm_90 on a CPU machine: no register spills for the bf16/fp16 configs below).
* Split-KV (flash-decoding): for long prefixes with few (batch x kv-head x M-tile) programs the prefix is cut into
  chunks (multiples of 128 keys, >= 512 keys each) so there are about 2 programs per SM; the last split also does the
  tree phase. Partial results (normalised output + log2-sum-exp) go to a float32 workspace and a second small kernel
  merges them. With one split the kernel writes the output directly (no workspace, one launch).
* On a GPU (fp16/bf16, head_dim <= 128), ``triton.autotune`` picks BLOCK_M / BLOCK_N / warps / stages from a small list,
  keeping BLOCK_M in [M_CAP/2, M_CAP] where M_CAP = next_pow2(N * G) clamped to [16, 128]; it is keyed only on
  constexprs and dtypes, so changing prefix/tree lengths never re-tune (a new M_CAP bucket or split/no-split does,
  once).
  ``EAGLE_FSD_TREE_ATTN_AUTOTUNE=0`` uses one fixed heuristic config instead (needed under CUDA-graph capture unless
  every shape was warmed up first). Under the interpreter there is one fixed config and no autotune.
"""

import triton
import triton.language as tl

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: keeps fully masked rows NaN-free


@triton.jit
def _attend_tile(acc, l_i, m_i, q, k, v, qk_scale, key_ok, HAS_MASK: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step over a K/V tile. key_ok: (BLOCK_M, BLOCK_N) or (1, BLOCK_N) bool, used when HAS_MASK."""
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale  # log2 domain
    if HAS_MASK:
        qk = tl.where(key_ok, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # m_i starts finite, so m_new is finite even for fully masked rows
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _load_kv(k_ptrs, v_ptrs, key_ok, MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """One K tile and one V tile (BLOCK, HEAD_DIM). MASKED: keys where key_ok (BLOCK,) is False read as zeros;
    unmasked, key_ok is not read (the prefix's full tiles do no mask work)."""
    if MASKED:
        k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _attend_prefix(acc, l_i, m_i, q, k_ptrs, v_ptrs, lo, hi, stride_kn, stride_vn, qk_scale,
                   BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Phase 1: the prefix keys [lo, hi) from k_ptrs / v_ptrs (at key lo), full BLOCK_N tiles without any mask work,
    then one boundary-masked tail tile."""
    offs_n = tl.arange(0, BLOCK_N)
    no_mask = offs_n[None, :] < BLOCK_N  # all True; unused when HAS_MASK is False
    n_full = tl.maximum(hi - lo, 0) // BLOCK_N
    for _ in range(0, n_full):
        k, v = _load_kv(k_ptrs, v_ptrs, offs_n, False, UPCAST)
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v, qk_scale, no_mask, False, IEEE)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    tail = lo + n_full * BLOCK_N
    if tail < hi:
        k_ok = (tail + offs_n) < hi
        k, v = _load_kv(k_ptrs, v_ptrs, k_ok, True, UPCAST)
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v, qk_scale, k_ok[None, :], True, IEEE)
    return acc, l_i, m_i


@triton.jit
def _attend_tree(acc, l_i, m_i, q, kt_ptrs, vt_ptrs, word_ptrs, row_ok, N, stride_kn, stride_vn, qk_scale,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Phase 2: the N tree keys from kt_ptrs / vt_ptrs (at key P), 32 keys per tile, one int32 mask word per row and
    tile from word_ptrs; a tile no row of the block sees is skipped."""
    offs_t = tl.arange(0, 32)
    for j0 in range(0, N, 32):
        words = tl.load(word_ptrs + j0 // 32, mask=row_ok, other=0)
        if tl.sum((words != 0).to(tl.int32), 0) > 0:  # skip tiles no row of this block can see
            j_ok = (j0 + offs_t) < N
            bits = (((words[:, None] >> offs_t[None, :]) & 1) != 0) & j_ok[None, :]
            k, v = _load_kv(kt_ptrs, vt_ptrs, j_ok, True, UPCAST)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v, qk_scale, bits, True, IEEE)
        kt_ptrs += 32 * stride_kn
        vt_ptrs += 32 * stride_vn
    return acc, l_i, m_i


@triton.jit
def _store_rows(acc, l_i, m_i, rows, row_ok, pid_s, OUT, WS_O, WS_LSE, R_TOTAL,
                HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr):
    """Epilogue: the normalised rows to OUT at `rows` of the (B, N, Hq) output or, with SPLIT, as float32 partials
    with their log2-sum-exp to this split's part of WS_O / WS_LSE."""
    offs_d = tl.arange(0, HEAD_DIM)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if SPLIT:
        ws = pid_s.to(tl.int64) * R_TOTAL + rows
        tl.store(WS_O + ws[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), _NEG_BIG)
        tl.store(WS_LSE + ws, lse, mask=row_ok)
    else:
        tl.store(OUT + rows[:, None] * HEAD_DIM + offs_d[None, :], o.to(OUT.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _tree_attn_fwd(
    Q, K, V, MASK, OUT, WS_O, WS_LSE,
    stride_qb, stride_qh, stride_qn,  # head_dim strides are 1 (the host makes sure), so tile loads vectorise
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_mb,
    N, P, HQ, HKV, G, M_TOTAL, W, CHUNK, R_TOTAL,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    M_CAP: tl.constexpr,  # padded M (autotune key / pruning only)
    SPLIT: tl.constexpr,  # write float32 partials to WS_O / WS_LSE instead of OUT
    UPCAST: tl.constexpr,  # compute in float32 after the loads (bf16 under the interpreter)
    IEEE: tl.constexpr,  # float32 operands: IEEE dots, not TF32
):
    pid_m, pid_bh, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b64 = (pid_bh // HKV).to(tl.int64)
    hkv = pid_bh % HKV
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < M_TOTAL
    qi = offs_m // G  # tree query index of each packed row
    qh = hkv * G + offs_m % G  # query head: this KV head's group, the row's head within it
    q_ptrs = (Q + b64 * stride_qb + qh[:, None].to(tl.int64) * stride_qh + qi[:, None].to(tl.int64) * stride_qn
              + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b64 * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hkv.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # phase 1: this split's prefix chunk [lo, hi)
    lo = pid_s * CHUNK
    hi = tl.minimum(lo + CHUNK, P)
    keys = (lo + tl.arange(0, BLOCK_N))[:, None].to(tl.int64)
    acc, l_i, m_i = _attend_prefix(acc, l_i, m_i, q, k_base + keys * stride_kn + offs_d[None, :],
                                   v_base + keys * stride_vn + offs_d[None, :], lo, hi, stride_kn, stride_vn,
                                   qk_scale, BLOCK_N, UPCAST, IEEE)
    # phase 2 (last split only): the N tree keys at [P, P + N)
    if pid_s == tl.num_programs(2) - 1:
        tree_keys = (P + tl.arange(0, 32))[:, None].to(tl.int64)
        acc, l_i, m_i = _attend_tree(acc, l_i, m_i, q, k_base + tree_keys * stride_kn + offs_d[None, :],
                                     v_base + tree_keys * stride_vn + offs_d[None, :],
                                     MASK + b64 * stride_mb + qi.to(tl.int64) * W, row_ok, N, stride_kn, stride_vn,
                                     qk_scale, UPCAST, IEEE)
    rows = (b64 * N + qi.to(tl.int64)) * HQ + qh  # row of the (B, N, Hq) output, same order in the workspace
    _store_rows(acc, l_i, m_i, rows, row_ok, pid_s, OUT, WS_O, WS_LSE, R_TOTAL, HEAD_DIM, SPLIT)


@triton.jit
def _tree_attn_combine(WS_O, WS_LSE, OUT, R_TOTAL, S, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    """Merge the split-KV partials: OUT[r] = sum_s 2^(lse_s - lse) * O_s[r]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < R_TOTAL
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_R], _NEG_BIG, dtype=tl.float32)
    l = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    for s in range(0, S):
        idx = s * R_TOTAL + rows
        lse = tl.load(WS_LSE + idx, mask=r_ok, other=_NEG_BIG)
        o = tl.load(WS_O + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=r_ok[:, None], other=0.0)
        m_new = tl.maximum(m, lse)
        a = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new)
        acc = acc * a[:, None] + w[:, None] * o
        l = l * a + w
        m = m_new
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(OUT + rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=r_ok[:, None])
