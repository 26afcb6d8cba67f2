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
  via the interpreter upcast). ``python -m eagle_fsd.eval.gpu_check`` runs the bf16 parity check and the timings on a
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

The kernels and their tiling: tree_attention_triton.py.
"""

import contextlib
import math
import os
from typing import Optional

import torch
import triton

from .tree_attention_triton import _tree_attn_combine, _tree_attn_fwd

__all__ = [
    "tree_attention",
    "tree_attention_reference",
    "pack_tree_mask",
    "unpack_tree_mask",
    "is_interpreting",
    "kernel_available",
]

_LOG2E = 1.4426950408889634  # the kernels take exp2: softmax scale * log2(e)
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
            raise ValueError(f"{name} must be a 4-D tensor, got {t.shape if isinstance(t, torch.Tensor) else type(t)}")
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


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the kernels size their split-KV / split-vocabulary grids by it);
    elsewhere (the Triton CPU interpreter) the 8 of a small GPU, so that the split paths run as they would there."""
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
        target = 2 * num_sms(device)
        num_splits = min(32, -(-target // max(programs, 1)), -(-prefix // min_chunk))
    num_splits = max(1, min(int(num_splits), prefix))
    if num_splits == 1:
        return 1, prefix
    align = _MAX_BLOCK_N if not _INTERPRETING else 16
    chunk = -(-prefix // num_splits)
    chunk = -(-chunk // align) * align
    return -(-prefix // chunk), chunk


def _check_supported(q: torch.Tensor, d: int) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"unsupported dtype {q.dtype}; use float16, bfloat16 or float32")
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"unsupported head_dim {d}: must be a power of two in [16, 256]")
    if not kernel_available(q.device):
        why = "TRITON_INTERPRET=1 was not set before import" if q.device.type == "cpu" else "no CUDA kernel"
        raise RuntimeError(f"tree_attention's Triton kernel cannot run on {q.device} ({why}); "
                           "use tree_attention_reference or SDPA with a dense mask there")


def _packed_mask(tree_mask: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """(packed int32 mask with unit word stride and dense rows, its batch stride: 0 when shared by the batch)."""
    packed = tree_mask if _is_packed(tree_mask, n) else pack_tree_mask(tree_mask)
    if packed.stride(-1) != 1 or packed.stride(-2) != packed.shape[-1]:
        packed = packed.contiguous()
    return packed, packed.stride(0) if packed.dim() == 3 and packed.shape[0] > 1 else 0


def _output(out, shape: tuple, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, device=q.device, dtype=q.dtype)
    if out.shape != shape or out.dtype != q.dtype or out.device != q.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {shape} {q.dtype} tensor on {q.device}")
    return out


def _run_kernels(args: tuple, meta: dict, grid_rows: tuple, splits: int, config, m_cap: int, ws: tuple):
    """Launch the forward kernel (autotuned or with a fixed config) on a (M tiles, B * Hkv, splits) grid, then the
    split-KV combine. Returns (config used, autotuned)."""
    m_total, programs_bh = grid_rows
    q = args[0]
    use_autotune = (config is None and _autotuned is not None and q.dtype != torch.float32 and meta["HEAD_DIM"] <= 128
                    and os.environ.get("EAGLE_FSD_TREE_ATTN_AUTOTUNE", "1") != "0")
    if use_autotune:
        grid = lambda meta_: (triton.cdiv(m_total, meta_["BLOCK_M"]), programs_bh, splits)  # noqa: E731
        _autotuned[grid](*args, **meta)
        cfg = _autotuned.best_config
    else:
        cfg = dict(config or _launch_config(m_cap, meta["HEAD_DIM"], q.dtype))
        if cfg["BLOCK_M"] < 16 or cfg["BLOCK_N"] < 16:
            raise ValueError("BLOCK_M and BLOCK_N must be >= 16 (tl.dot minimum on GPUs)")
        _tree_attn_fwd[(triton.cdiv(m_total, cfg["BLOCK_M"]), programs_bh, splits)](*args, **meta, **cfg)
    if splits > 1:
        ws_o, ws_lse, out, rows_total = ws
        block_r = 16
        _tree_attn_combine[(triton.cdiv(rows_total, block_r),)](
            ws_o, ws_lse, out, rows_total, splits, HEAD_DIM=meta["HEAD_DIM"], BLOCK_R=block_r, num_warps=4)
    return cfg, use_autotune


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

    q: (B, Hq, N, D) queries of the N tree tokens. k, v: (B, Hkv, L, D), the tree's keys/values are the last N of L;
    any strides. tree_mask: bool (N, N) / (B, N, N), True = query i may attend tree key j; or the int32 output of
    :func:`pack_tree_mask` (pack once, reuse across layers). scale: softmax scale, default 1/sqrt(D).
    out: optional preallocated (B, N, Hq, D) contiguous output of q's dtype (written completely).
    num_splits: force the number of split-KV chunks of the prefix (default: heuristic; 1 = no split).
    config: force a launch config {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} (no autotune).
    """
    B, hq, n, d, hkv, length = _check_inputs(q, k, v, tree_mask)
    _check_supported(q, d)
    # The kernel assumes unit stride along head_dim (true for transformers' q/k/v and cache views); copy otherwise.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    g, prefix = hq // hkv, length - n
    packed, stride_mb = _packed_mask(tree_mask, n)
    out = _output(out, (B, n, hq, d), q)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    m_total = n * g
    m_cap = min(128, max(16, _next_pow2(m_total)))
    rows_total = B * n * hq
    splits, chunk = _choose_splits(prefix, -(-m_total // min(m_cap, 64)) * B * hkv, q.device, num_splits)
    if splits > 1:
        ws_o = torch.empty((splits, rows_total, d), device=q.device, dtype=torch.float32)
        ws_lse = torch.empty((splits, rows_total), device=q.device, dtype=torch.float32)
    else:
        ws_o = ws_lse = out  # unused
    upcast = _INTERPRETING and q.dtype == torch.bfloat16
    args = (q, k, v, packed, out, ws_o, ws_lse,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], stride_mb,
            n, prefix, hq, hkv, g, m_total, packed.shape[-1], chunk, rows_total,
            float(scale) * _LOG2E)
    meta = dict(HEAD_DIM=d, M_CAP=m_cap, SPLIT=splits > 1, UPCAST=upcast, IEEE=upcast or q.dtype == torch.float32)
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        cfg, autotuned = _run_kernels(args, meta, (m_total, B * hkv), splits, config, m_cap,
                                      (ws_o, ws_lse, out, rows_total))
    global last_launch
    last_launch = (splits, cfg, autotuned)
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
