"""Fused divergences between two softmaxes, straight from the logits: a Triton kernel (full-vocabulary variants).

What it computes
----------------
``fused_divergence(target_logits, draft_logits, name)`` returns, for every row (tree node), the divergence ``name``
between p = softmax(target row) and q = softmax(draft row): the same quantity, numerics and edge cases as
:func:`divergence_reference` (float64 torch, this module) and FSD's float32 torch divergences
(eagle_fsd/divergence.py, whose docstring defines them), without materialising any (N, V) float32 intermediate. Names:
``FUSED_DIVERGENCES`` = kl_qp, kl_pq, jsd, jsd_bits, tv, legacy_js. Top-k variants are not fused (FSD does them in
torch).

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
  imported). Everything else raises; the torch divergences are the fallback there.
* Tested hardware: not yet timed on a GPU. Correctness is tested on CPU under the Triton interpreter (fp32, fp16, bf16
  via the upcast); the kernels are compiled (not run) for sm_90 in the tests (16-byte loads, no spills).
  ``python -m eagle_fsd.eval.gpu_check`` runs a bf16 parity check and times the kernel against the torch reference
  on a GPU.

The kernels and their design: divergence_triton.py.
"""

import contextlib
import math
from typing import Optional

import torch
import triton

from .divergence_triton import _div_combine_kernel, _div_fused_kernel, _div_partial_kernel, _div_stats_kernel
from .tree_attention import _next_pow2, kernel_available, num_sms

__all__ = ["fused_divergence", "fused_divergence_available", "divergence_reference", "FUSED_DIVERGENCES"]

FUSED_DIVERGENCES = ("kl_qp", "kl_pq", "jsd", "jsd_bits", "tv", "legacy_js")  # the NAME values the kernels implement

_INTERPRETING = type(_div_fused_kernel).__name__ == "InterpretedFunction"

_GPU_CONFIG = {"BLOCK_V": 2048, "num_warps": 8}
_INTERP_CONFIG = {"BLOCK_V": 1024, "num_warps": 4}
_MIN_TILES_PER_SPLIT = 4  # a split chunk is at least this many BLOCK_V tiles
_PROGRAMS_PER_SM = 4
_MAX_SPLITS = 64
_BLOCK_R = 16
last_launch = None  # (splits, config) of the latest call; for gpu_check / debugging


def fused_divergence_available(device) -> bool:
    """Whether :func:`fused_divergence` can run on ``device``: CUDA, or CPU under the Triton interpreter."""
    return kernel_available(device)


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
    if name not in FUSED_DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; valid names: {', '.join(FUSED_DIVERGENCES)}")
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


def _output(out, lead: tuple, device) -> torch.Tensor:
    if out is None:
        return torch.empty(lead, device=device, dtype=torch.float32)
    if (not isinstance(out, torch.Tensor) or tuple(out.shape) != lead or out.dtype != torch.float32
            or out.device != device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 tensor of shape {lead} on {device}")
    return out


def _launch_config(config: Optional[dict]) -> tuple[int, int]:
    """(BLOCK_V, num_warps): the forced config, else the GPU's or the interpreter's."""
    cfg = dict(config or (_INTERP_CONFIG if _INTERPRETING else _GPU_CONFIG))
    block_v = int(cfg.get("BLOCK_V", 0))
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"config BLOCK_V must be a power of two >= 16, got {cfg.get('BLOCK_V')!r}")
    return block_v, int(cfg.get("num_warps", 4))


def _launch(t2, d2, out, name: str, splits: int, chunk: int, block_v: int, num_warps: int) -> None:
    """One fused launch (splits == 1), else stats -> partial sums -> combine over `splits` vocabulary chunks."""
    rows, vocab = t2.shape
    strides = (t2.stride(0), t2.stride(1), d2.stride(0), d2.stride(1))
    if splits == 1:
        _div_fused_kernel[(rows,)](t2, d2, out, *strides, vocab, NAME=name, BLOCK_V=block_v, num_warps=num_warps)
        return
    s_pow2 = max(16, _next_pow2(splits))
    ws = torch.empty((rows, splits, 4), device=t2.device, dtype=torch.float32)
    part = torch.empty((rows, splits), device=t2.device, dtype=torch.float32)
    _div_stats_kernel[(rows, splits)](t2, d2, ws, *strides, vocab, chunk, splits, BLOCK_V=block_v,
                                      num_warps=num_warps)
    _div_partial_kernel[(rows, splits)](t2, d2, ws, part, *strides, vocab, chunk, splits, NAME=name,
                                        BLOCK_V=block_v, S_POW2=s_pow2, num_warps=num_warps)
    _div_combine_kernel[(triton.cdiv(rows, _BLOCK_R),)](part, out, rows, splits, NAME=name, BLOCK_R=_BLOCK_R,
                                                        S_POW2=s_pow2, num_warps=4)


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
    streaming pass pair (see the module docstring); equals :func:`divergence_reference` within float32 rounding.

    Args:
        target_logits: (..., V) target logits or log-probs, float32 / float16 / bfloat16, any strides.
        draft_logits: (..., V) draft logits, same V; leading dims broadcast with the target's.
        name: one of ``FUSED_DIVERGENCES``.
        out: optional preallocated contiguous float32 output of the broadcast leading shape (written completely).
        num_splits: force the number of vocabulary chunks per row (default: heuristic; 1 = one program per row).
        config: force {"BLOCK_V": power of two >= 16, "num_warps": int}.

    Returns (...) float32: +inf where mathematically infinite, NaN for rows with a NaN / +inf logit or only -inf
    logits. Raises ValueError (unknown ``name``, mismatched shapes, empty vocab, device mismatch, bad ``out`` /
    ``config``), TypeError (non-tensor input, unsupported dtype), RuntimeError (the device cannot run the kernel).
    """
    target_logits, draft_logits = _check(target_logits, draft_logits, name)
    device = target_logits.device
    if not fused_divergence_available(device):
        why = "TRITON_INTERPRET=1 was not set before import" if device.type == "cpu" else "no CUDA kernel"
        raise RuntimeError(f"fused_divergence's Triton kernel cannot run on {device} ({why}); "
                           "use eagle_fsd.divergence.divergence (or divergence_reference) there")
    vocab = target_logits.shape[-1]
    out = _output(out, tuple(target_logits.shape[:-1]), device)
    t2, d2 = _as_2d(target_logits, vocab), _as_2d(draft_logits, vocab)
    block_v, num_warps = _launch_config(config)
    if num_splits is None and _INTERPRETING:
        num_splits = 1  # no parallelism to gain on the CPU interpreter
    splits, chunk = _split_plan(t2.shape[0], vocab, block_v, num_sms(device), num_splits)
    global last_launch
    last_launch = (splits, {"BLOCK_V": block_v, "num_warps": num_warps})
    if t2.shape[0] == 0:
        return out
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _launch(t2, d2, out, name, splits, chunk, block_v, num_warps)
    return out


def divergence_reference(target_logits: torch.Tensor, draft_logits: torch.Tensor, name: str = "kl_qp") -> torch.Tensor:
    """What :func:`fused_divergence` computes, in float64 torch: (...) float64, same edge cases (a NaN row where a
    log-softmax has NaN; every a * (ln a - ln b) term 0 where a == 0; clamped to the mathematical range)."""
    if name not in FUSED_DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; valid names: {', '.join(FUSED_DIVERGENCES)}")
    logp = torch.log_softmax(target_logits.double(), dim=-1)
    logq = torch.log_softmax(draft_logits.double(), dim=-1)
    p, q = logp.exp(), logq.exp()

    def kl_sum(a, log_a, log_b):  # sum a (ln a - ln b), 0 * log 0 = 0
        return torch.where(a == 0, 0.0, a * (log_a - log_b)).sum(dim=-1)

    ln2 = math.log(2.0)
    logm = torch.where(logp == logq, logp, torch.logaddexp(logp, logq) - ln2)  # m = (p + q) / 2
    if name == "kl_qp":
        value = kl_sum(q, logq, logp)
    elif name == "kl_pq":
        value = kl_sum(p, logp, logq)
    elif name == "tv":
        value = 0.5 * (p - q).abs().sum(dim=-1)
    elif name == "legacy_js":  # 1/2 KL(m||p) + 1/2 KL(m||q): not Jensen-Shannon (paper parity)
        value = 0.5 * kl_sum(logm.exp(), logm, logp) + 0.5 * kl_sum(logm.exp(), logm, logq)
    else:  # jsd = 1/2 KL(p||m) + 1/2 KL(q||m); jsd_bits = jsd / ln 2
        value = (0.5 * kl_sum(p, logp, logm) + 0.5 * kl_sum(q, logq, logm)) / (ln2 if name == "jsd_bits" else 1.0)
    upper = {"jsd": ln2, "jsd_bits": 1.0, "tv": 1.0}.get(name, math.inf)
    bad = logp.isnan().any(dim=-1) | logq.isnan().any(dim=-1)
    return torch.where(bad, math.nan, value.clamp(0.0, upper))
