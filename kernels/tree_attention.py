"""Tree attention for speculative-decoding verification: a Triton kernel and a float64 PyTorch reference.

What it computes
----------------
``tree_attention(q, k, v, tree_mask)`` is softmax attention of the ``N`` tree tokens (the queries) over ``L = P + N``
keys: the ``P`` prefix keys (the accepted context already in the KV cache) are visible to every query, and the last
``N`` keys (the tree tokens themselves, appended to the cache) are visible to query ``i`` only where ``tree_mask[i, j]``
is True (usually "j is an ancestor of i, or i itself"). A causal prefill is the special case ``P = 0``, lower-triangular
mask; a decode step is ``N = 1``.

Shapes and layouts (the transformers ``AttentionInterface`` convention):
    q:         (B, Hq, N, D)             any strides
    k, v:      (B, Hkv, L, D), L >= N    any strides (e.g. views ``cache[:, :, :L]`` of a preallocated cache);
                                         GQA is not expanded: Hq % Hkv == 0
               (the kernel takes strides for B, H and L; a tensor whose head_dim stride is not 1 is copied first)
    tree_mask: bool (N, N) or (B, N, N), or an already packed int32 mask (N, W) / (B, N, W), W = ceil(N / 32),
               from :func:`pack_tree_mask` (pack once per forward and reuse it in every layer)
    returns:   (B, N, Hq, D) contiguous, q's dtype

Limits
------
* dtypes: float16, bfloat16 (the fast path), float32; q, k and v must share one. Accumulation and softmax are float32
  (online softmax, exp2 domain). float32 inputs use IEEE (not TF32) dots, which run on FMAs: on a GPU they use small
  fixed tiles, are not autotuned and are meant for correctness, not speed.
* head_dim: a power of two in [16, 256] (64 and 128 are the tested ones; 256 uses a fixed small-tile config).
* tree size N: no hard limit (W = ceil(N/32) mask words per row; tree keys are processed 32 at a time), but the tiling
  is designed for N <= 64 tree nodes (times the GQA group). A long causal prefill (large N, P = 0) is correct but slower
  than SDPA(is_causal=True): prefer SDPA there. Fully masked 32-key tree tiles are skipped.
* The prefix is visible to every query: padding/attention masks inside the prefix are not supported (batch > 1 needs
  equal prefix lengths, or right-aligned, unpadded caches).
* A mask row without any True is allowed: with P > 0 the node attends to the prefix only; with P = 0 its output is 0
  (never NaN). The reference does the same.
* Devices: CUDA, or CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before this module is
  imported).
  Everything else raises; use :func:`tree_attention_reference` (or SDPA with a dense mask) as the fallback there.
* Tested hardware: not yet timed on a GPU. Correctness is tested on CPU under the Triton interpreter (fp32, fp16, bf16
  via the interpreter upcast). ``python -m eagle_fsd.kernels.gpu_check`` runs the bf16 parity check and the timings on a
  GPU.

Mask format: bit-packed int32 words
-----------------------------------
The kernel reads the mask as ``[B or 1, N, ceil(N/32)]`` int32 words, bit ``j % 32`` of word ``j // 32`` of row ``i``
set iff query i sees tree key j (little bit order, numpy/FlashInfer ``packbits(bitorder="little")`` semantics; the
TensorRT-LLM XQA spec-dec layout). Why:
* only the N x N tree block is stored; the prefix is implicitly all-visible, so the mask costs nothing on prefix tiles;
* 32x smaller than an int32 matrix, 8x smaller than bool/int8 (64 nodes: 512 bytes per request instead of 4 KiB), so a
  per-request mask for a dynamic tree stays in L1/L2 and the gather + shift + and is cheaper than reading a byte matrix;
* it is the format peers (TRT-LLM, FlashInfer, SGLang's bit-packing mode) produce, so tree builders can emit it
  directly;
* no size cap (unlike a single uint32/uint64 word per row).
Packing happens on the host in vectorised torch (:func:`pack_tree_mask`): a handful of small tensor ops, no loop over
nodes.

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

import contextlib
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = [
    "tree_attention",
    "tree_attention_reference",
    "pack_tree_mask",
    "unpack_tree_mask",
    "is_interpreting",
    "kernel_available",
]

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: keeps fully masked rows NaN-free
_LOG2E = 1.4426950408889634  # host side only


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------------


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
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // HKV
    hkv = pid_bh % HKV
    b64 = b.to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < M_TOTAL
    qi = offs_m // G  # tree query index of each packed row
    qg = offs_m % G  # head within the GQA group
    qh = hkv * G + qg  # query head

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
    no_mask = offs_n[None, :] < BLOCK_N  # all True; unused when HAS_MASK is False

    # ---- phase 1: this split's prefix chunk [lo, hi), no mask work on full tiles ----
    lo = pid_s * CHUNK
    hi = tl.minimum(lo + CHUNK, P)
    n_full = tl.maximum(hi - lo, 0) // BLOCK_N
    k_ptrs = k_base + (lo + offs_n)[:, None].to(tl.int64) * stride_kn + offs_d[None, :]
    v_ptrs = v_base + (lo + offs_n)[:, None].to(tl.int64) * stride_vn + offs_d[None, :]
    for _ in range(0, n_full):
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v, qk_scale, no_mask, False, IEEE)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    tail = lo + n_full * BLOCK_N
    if tail < hi:
        k_ok = (tail + offs_n) < hi
        k = tl.load(k_ptrs, mask=k_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v, qk_scale, k_ok[None, :], True, IEEE)

    # ---- phase 2 (last split only): the N tree keys at [P, P + N), 32 keys (one mask word per row) per tile ----
    if pid_s == tl.num_programs(2) - 1:
        offs_t = tl.arange(0, 32)
        word_ptrs = MASK + b64 * stride_mb + qi.to(tl.int64) * W
        kt_ptrs = k_base + (P + offs_t)[:, None].to(tl.int64) * stride_kn + offs_d[None, :]
        vt_ptrs = v_base + (P + offs_t)[:, None].to(tl.int64) * stride_vn + offs_d[None, :]
        for j0 in range(0, N, 32):
            words = tl.load(word_ptrs + j0 // 32, mask=row_ok, other=0)
            if tl.sum((words != 0).to(tl.int32), 0) > 0:  # skip tiles no row of this block can see
                j_ok = (j0 + offs_t) < N
                bits = (((words[:, None] >> offs_t[None, :]) & 1) != 0) & j_ok[None, :]
                k = tl.load(kt_ptrs, mask=j_ok[:, None], other=0.0)
                v = tl.load(vt_ptrs, mask=j_ok[:, None], other=0.0)
                if UPCAST:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v, qk_scale, bits, True, IEEE)
            kt_ptrs += 32 * stride_kn
            vt_ptrs += 32 * stride_vn

    # ---- epilogue ----
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    rows = (b64 * N + qi.to(tl.int64)) * HQ + qh  # row of the (B, N, Hq) output, same order in the workspace
    if SPLIT:
        ws = pid_s.to(tl.int64) * R_TOTAL + rows
        tl.store(WS_O + ws[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), _NEG_BIG)
        tl.store(WS_LSE + ws, lse, mask=row_ok)
    else:
        tl.store(OUT + rows[:, None] * HEAD_DIM + offs_d[None, :], o.to(OUT.dtype.element_ty), mask=row_ok[:, None])


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


_INTERPRETING = type(_tree_attn_fwd).__name__ == "InterpretedFunction"

# GPU autotune space (H100/H200, fp16/bf16, head_dim <= 128). _prune_configs keeps BLOCK_M in [M_CAP/2, M_CAP].
# All compile without register spills for sm_90 at head_dim 128 (triton 3.9, checked offline).
_GPU_CONFIGS = [
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
]
_MAX_BLOCK_N = 128  # split chunks are multiples of this, so every config tiles them evenly


def _prune_configs(configs, named_args, **kwargs):
    """Keep BLOCK_M in [M_CAP / 2, M_CAP]: larger wastes rows, smaller re-reads K/V more (and compiles cost time)."""
    cap = kwargs.get("M_CAP", named_args.get("M_CAP"))
    kept = [c for c in configs if cap // 2 <= c.kwargs["BLOCK_M"] <= cap]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"])]


def _make_autotuned(configs=None, do_bench=None):
    """The autotuned launcher (GPU). ``do_bench`` is only for exercising this path under the interpreter in tests."""
    return triton.autotune(
        configs=list(configs or _GPU_CONFIGS),
        key=["HEAD_DIM", "M_CAP", "SPLIT", "UPCAST", "IEEE"],
        prune_configs_by={"early_config_prune": _prune_configs},
        do_bench=do_bench,
    )(_tree_attn_fwd)


_autotuned = None if _INTERPRETING else _make_autotuned()
last_launch = None  # (splits, config, autotuned) of the latest call; for gpu_check / debugging


def is_interpreting() -> bool:
    """True when the kernels were built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    return _INTERPRETING


def kernel_available(device) -> bool:
    """Whether :func:`tree_attention` can run on ``device``: CUDA, or CPU under the Triton interpreter."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and not _INTERPRETING
    if device.type == "cpu":
        return _INTERPRETING
    return False


# ----------------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------------


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def pack_tree_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    """Bit-pack a bool tree mask (N, N) or (B, N, N) into int32 words (B or 1, N, ceil(N/32)), little bit order."""
    if tree_mask.dtype.is_floating_point or tree_mask.dtype.is_complex:
        raise TypeError("tree_mask must be bool (True = may attend); convert an additive float mask with `mask == 0`")
    if tree_mask.dim() == 2:
        tree_mask = tree_mask.unsqueeze(0)
    if tree_mask.dim() != 3 or tree_mask.shape[-1] != tree_mask.shape[-2]:
        raise ValueError(f"tree_mask must have shape (N, N) or (B, N, N), got {tuple(tree_mask.shape)}")
    bm, n, _ = tree_mask.shape
    w = (n + 31) // 32
    bits = torch.nn.functional.pad((tree_mask != 0).to(torch.int64), (0, w * 32 - n))
    shifts = torch.arange(32, device=tree_mask.device, dtype=torch.int64)
    words = (bits.view(bm, n, w, 32) << shifts).sum(-1)  # distinct bits: sum == or
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32).contiguous()


def unpack_tree_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_tree_mask`: int32 (…, N, W) -> bool (…, N, N)."""
    shifts = torch.arange(32, device=packed.device, dtype=torch.int64)
    bits = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :n].bool()


def _is_packed(tree_mask: torch.Tensor, n: int) -> bool:
    return tree_mask.dtype == torch.int32 and tree_mask.dim() in (2, 3) and tree_mask.shape[-1] == (n + 31) // 32 \
        and tree_mask.shape[-2] == n


def _check_inputs(q, k, v, tree_mask):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor, got {getattr(t, 'shape', type(t))}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    B, hq, n, d = q.shape
    bk, hkv, length, dk = k.shape
    if bk != B:
        raise ValueError(f"batch mismatch: q has {B}, k/v have {bk}")
    if dk != d:
        raise ValueError(f"head_dim mismatch: q has {d}, k/v have {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"number of query heads ({hq}) must be a multiple of the number of kv heads ({hkv})")
    if n < 1:
        raise ValueError("the tree must have at least one token (q.shape[2] >= 1)")
    if length < n:
        raise ValueError(f"k/v length L={length} is smaller than the number of tree tokens N={n}; the tree's keys must "
                         "be the last N entries of k/v (append them to the cache first)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == tree_mask.device):
        raise ValueError(f"device mismatch: q {q.device}, k {k.device}, v {v.device}, tree_mask {tree_mask.device}")
    if not (_is_packed(tree_mask, n) or (tree_mask.dim() in (2, 3) and tuple(tree_mask.shape[-2:]) == (n, n))):
        raise ValueError(f"tree_mask must be (N, N) or (B, N, N) bool with N={n} (or packed int32 (..., N, "
                         f"{(n + 31) // 32})), got {tuple(tree_mask.shape)} {tree_mask.dtype}")
    if tree_mask.dim() == 3 and tree_mask.shape[0] not in (1, B):
        raise ValueError(f"tree_mask batch {tree_mask.shape[0]} does not match q batch {B}")
    return B, hq, n, d, hkv, length


def _launch_config(m_cap: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Fixed config: the interpreter's single config, float32 on a GPU (IEEE dots run on FMAs: small tiles, not
    autotuned, correctness rather than speed), or the fp16/bf16 GPU default when autotuning is off."""
    if _INTERPRETING:
        return {"BLOCK_M": min(m_cap, 64), "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        return {"BLOCK_M": min(m_cap, 32), "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    if head_dim > 128:
        return {"BLOCK_M": min(m_cap, 64), "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": min(m_cap, 64), "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


_SM_COUNT = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _choose_splits(prefix: int, programs: int, device: torch.device, num_splits: Optional[int]):
    """Returns (splits, chunk). Every split gets >= 1 prefix key; the last one also does the tree keys."""
    if prefix <= 0:
        return 1, 0
    if num_splits is None:
        min_chunk = 512
        target = 2 * _num_sms(device)
        num_splits = min(32, -(-target // max(programs, 1)), -(-prefix // min_chunk))
    num_splits = max(1, min(int(num_splits), prefix))
    if num_splits == 1:
        return 1, prefix
    align = _MAX_BLOCK_N if not _INTERPRETING else 16
    chunk = -(-prefix // num_splits)
    chunk = -(-chunk // align) * align
    return -(-prefix // chunk), chunk


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: Optional[float] = None,
    *,
    out: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """Tree attention (see the module docstring). Returns (B, N, Hq, D) contiguous in q's dtype.

    Args:
        q: (B, Hq, N, D) queries of the N tree tokens.
        k, v: (B, Hkv, L, D), the tree's keys/values are the last N of L; any strides.
        tree_mask: bool (N, N) / (B, N, N), True = query i may attend tree key j; or the int32 output of
            :func:`pack_tree_mask` (pack once, reuse across layers).
        scale: softmax scale, default 1/sqrt(D).
        out: optional preallocated (B, N, Hq, D) contiguous output of q's dtype (written completely).
        num_splits: force the number of split-KV chunks of the prefix (default: heuristic; 1 = no split).
        config: force a launch config {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} (no autotune).
    """
    B, hq, n, d, hkv, length = _check_inputs(q, k, v, tree_mask)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"unsupported dtype {q.dtype}; use float16, bfloat16 or float32")
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"unsupported head_dim {d}: must be a power of two in [16, 256]")
    if not kernel_available(q.device):
        why = "TRITON_INTERPRET=1 was not set before import" if q.device.type == "cpu" else "no CUDA kernel"
        raise RuntimeError(f"tree_attention's Triton kernel cannot run on {q.device} ({why}); "
                           "use tree_attention_reference or SDPA with a dense mask there")
    # The kernel assumes unit stride along head_dim (true for transformers' q/k/v and cache views); copy otherwise.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    g = hq // hkv
    prefix = length - n
    packed = tree_mask if _is_packed(tree_mask, n) else pack_tree_mask(tree_mask)
    if packed.stride(-1) != 1 or packed.stride(-2) != packed.shape[-1]:
        packed = packed.contiguous()
    stride_mb = packed.stride(0) if packed.dim() == 3 and packed.shape[0] > 1 else 0

    if out is None:
        out = torch.empty((B, n, hq, d), device=q.device, dtype=q.dtype)
    elif out.shape != (B, n, hq, d) or out.dtype != q.dtype or out.device != q.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {(B, n, hq, d)} {q.dtype} tensor on {q.device}")

    if scale is None:
        scale = 1.0 / math.sqrt(d)
    m_total = n * g
    m_cap = min(128, max(16, _next_pow2(m_total)))
    rows_total = B * n * hq
    splits, chunk = _choose_splits(prefix, -(-m_total // min(m_cap, 64)) * B * hkv, q.device, num_splits)
    split = splits > 1
    if split:
        ws_o = torch.empty((splits, rows_total, d), device=q.device, dtype=torch.float32)
        ws_lse = torch.empty((splits, rows_total), device=q.device, dtype=torch.float32)
    else:
        ws_o = ws_lse = out  # unused
    upcast = _INTERPRETING and q.dtype == torch.bfloat16
    ieee = upcast or q.dtype == torch.float32

    args = (q, k, v, packed, out, ws_o, ws_lse,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], stride_mb,
            n, prefix, hq, hkv, g, m_total, packed.shape[-1], chunk, rows_total,
            float(scale) * _LOG2E)
    meta = dict(HEAD_DIM=d, M_CAP=m_cap, SPLIT=split, UPCAST=upcast, IEEE=ieee)

    use_autotune = (config is None and _autotuned is not None and q.dtype != torch.float32 and d <= 128
                    and os.environ.get("EAGLE_FSD_TREE_ATTN_AUTOTUNE", "1") != "0")
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        if use_autotune:
            grid = lambda meta_: (triton.cdiv(m_total, meta_["BLOCK_M"]), B * hkv, splits)  # noqa: E731
            _autotuned[grid](*args, **meta)
            cfg = _autotuned.best_config
        else:
            cfg = dict(config or _launch_config(m_cap, d, q.dtype))
            if cfg["BLOCK_M"] < 16 or cfg["BLOCK_N"] < 16:
                raise ValueError("BLOCK_M and BLOCK_N must be >= 16 (tl.dot minimum on GPUs)")
            grid = (triton.cdiv(m_total, cfg["BLOCK_M"]), B * hkv, splits)
            _tree_attn_fwd[grid](*args, **meta, **cfg)
        if split:
            block_r = 16
            _tree_attn_combine[(triton.cdiv(rows_total, block_r),)](
                ws_o, ws_lse, out, rows_total, splits, HEAD_DIM=d, BLOCK_R=block_r, num_warps=4)
    global last_launch
    last_launch = (splits, cfg, use_autotune)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------------------


def tree_attention_reference(q, k, v, tree_mask, scale=None):
    """Plain PyTorch tree attention in float64 (same signature and output layout as :func:`tree_attention`).

    Builds the dense (B, N, L) visibility (prefix all True, tree block = tree_mask), expands GQA with
    repeat_interleave, and runs masked softmax. Fully masked rows give 0. Works on any device; O(B*Hq*N*L) memory.
    """
    B, hq, n, d, hkv, length = _check_inputs(q, k, v, tree_mask)
    prefix = length - n
    mask = unpack_tree_mask(tree_mask, n) if _is_packed(tree_mask, n) else (tree_mask != 0)
    if mask.dim() == 2:
        mask = mask.unsqueeze(0)
    visible = torch.ones((mask.shape[0], n, length), dtype=torch.bool, device=q.device)
    visible[:, :, prefix:] = mask
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qd = q.to(torch.float64)
    kd = k.to(torch.float64).repeat_interleave(g, dim=1)
    vd = v.to(torch.float64).repeat_interleave(g, dim=1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = p @ vd  # (B, Hq, N, D)
    return o.transpose(1, 2).contiguous().to(q.dtype)
