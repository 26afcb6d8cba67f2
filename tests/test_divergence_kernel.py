"""Fused divergence kernel (eagle_fsd.kernels.fused_divergence) against the torch reference
eagle_fsd.divergence.divergence. Without CUDA the Triton kernels run on CPU under the interpreter (conftest.py sets
TRITON_INTERPRET=1 before anything imports them); vocabularies and row counts are small to keep the file fast."""

import importlib
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from eagle_fsd.divergence import DIVERGENCES, divergence
from eagle_fsd.kernels import FUSED_DIVERGENCES, divergence_reference, fused_divergence, fused_divergence_available

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [
    pytest.mark.skipif(not fused_divergence_available(DEVICE), reason="no CUDA and TRITON_INTERPRET!=1 at import"),
    # -inf - -inf in padding lanes / unselected where() branches: numpy warns under the interpreter, the result is fine
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

RTOL, ATOL = 1e-4, 1e-5
POISON = -7.0  # every divergence is >= 0 or NaN, so a leftover -7 means an unwritten element
SMALL = {"BLOCK_V": 128, "num_warps": 4}  # several tiles (and splits) even at small V
NEG_INF, POS_INF, NAN = float("-inf"), float("inf"), float("nan")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _run(t, d, name, **kw):
    """fused_divergence into a poisoned output; checks every element was written."""
    lead = torch.broadcast_shapes(t.shape[:-1], d.shape[:-1])
    out = torch.full(lead, POISON, dtype=torch.float32, device=DEVICE)
    res = fused_divergence(t, d, name, out=out, **kw)
    assert res is out and res.dtype == torch.float32 and tuple(res.shape) == tuple(lead)
    assert not (res == POISON).any(), "unwritten output elements"
    return res


def _assert_close(got, ref, what=""):
    got, ref = got.cpu(), ref.cpu()
    assert got.shape == ref.shape and got.dtype == ref.dtype == torch.float32
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{what}: NaN pattern {got} vs {ref}"
    assert torch.equal(torch.isposinf(got), torch.isposinf(ref)), f"{what}: +inf pattern {got} vs {ref}"
    fin = torch.isfinite(ref)
    err = (got[fin].double() - ref[fin].double()).abs()
    tol = ATOL + RTOL * ref[fin].double().abs()
    assert (err <= tol).all(), f"{what}: max err {err.max():.3e}; got {got} ref {ref}"


def _logits(rows, vocab, gen, scale=1.0):
    """Target rows and draft rows: independent, correlated (noise 0.3), nearly identical (noise 1e-3)."""
    t = torch.randn(rows, vocab, generator=gen) * scale
    noise = torch.randn(rows, vocab, generator=gen) * scale
    level = torch.tensor([1.0, 0.3, 1e-3] * rows)[:rows, None]
    d = torch.where(level == 1.0, noise, t + level * noise)
    return t, d


# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab,dtype,scale", [
    (50, torch.float32, 1.0),
    (257, torch.float32, 10.0),
    (3000, torch.float32, 1.0),
    (3000, torch.float32, 10.0),
    (1000, torch.float16, 1.0),
    (1000, torch.float16, 10.0),
    (257, torch.bfloat16, 1.0),
    (1000, torch.bfloat16, 10.0),
])
def test_parity_random(vocab, dtype, scale):
    t, d = _logits(3, vocab, _gen(vocab + int(scale)), scale)
    t, d = t.to(DEVICE, dtype), d.to(DEVICE, dtype)
    for name in DIVERGENCES:
        _assert_close(_run(t, d, name), divergence(t, d, name), f"{name} V={vocab} {dtype} x{scale}")


def test_parity_with_own_float64_reference():
    """The kernel against its own float64 reference (kernels/ needs nothing of eagle_fsd to be checked)."""
    t, d = _edge_rows(700)
    d[8] = t[8]  # identical rows: exactly 0
    for name in FUSED_DIVERGENCES:
        ref = divergence_reference(t, d, name)
        assert ref.dtype == torch.float64 and ref[8] == 0 and ref[5].isnan()
        _assert_close(_run(t.to(DEVICE), d.to(DEVICE), name, config=SMALL, num_splits=2), ref.float(), name)
    with pytest.raises(ValueError, match="unknown divergence"):
        divergence_reference(t, d, "kl")


def test_own_reference_matches_fsd_divergences():
    """The kernel's float64 reference and FSD's float32 torch divergences define the same quantities."""
    t, d = _edge_rows()
    for name in FUSED_DIVERGENCES:
        _assert_close(divergence(t, d, name), divergence_reference(t, d, name).float(), name)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_tiles_and_splits(num_splits):
    """BLOCK_V=128 at V=1000: 7 full tiles + a 104-token tail; split into 3 chunks, or one chunk per tile (8)."""
    t, d = _logits(3, 1000, _gen(7), 3.0)
    t, d = t.to(DEVICE), d.to(DEVICE)
    for name in DIVERGENCES:
        got = _run(t, d, name, num_splits=num_splits, config=SMALL)
        _assert_close(got, divergence(t, d, name), f"{name} splits={num_splits}")
    assert importlib.import_module("eagle_fsd.kernels.divergence").last_launch[0] == num_splits
    if num_splits == 3:  # one chunk per tile (a forced count is clamped to the 8 tiles)
        _assert_close(_run(t, d, "jsd", num_splits=100, config=SMALL), divergence(t, d, "jsd"), "jsd splits=8")
        assert importlib.import_module("eagle_fsd.kernels.divergence").last_launch[0] == 8


def test_default_split_heuristic():
    """The GPU heuristic (132 SMs, BLOCK_V 2048): ~4 programs per SM, chunks of >= 4 tiles, a multiple of BLOCK_V."""
    plan = importlib.import_module("eagle_fsd.kernels.divergence")._split_plan
    for rows, vocab, splits in [(64, 128256, 9), (64, 152064, 9), (64, 32000, 4), (1, 152064, 19), (600, 128256, 1),
                                (64, 1000, 1), (1, 10**7, 64)]:
        s, chunk = plan(rows, vocab, 2048, 132, None)
        assert s == splits, (rows, vocab, s)
        assert chunk % 2048 == 0 and (s - 1) * chunk < vocab <= s * chunk
    assert plan(3, 1000, 64, 132, 100) == (16, 64)  # forced: clamped to one tile per split
    assert plan(3, 1000, 64, 132, 3) == (3, 384)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_identical_rows_exactly_zero(num_splits):
    t = (torch.randn(3, 300, generator=_gen(3)) * torch.tensor([1.0, 20.0, 3.0])[:, None])
    t[2, ::7] = NEG_INF  # zero-probability tokens in both rows
    t = t.to(DEVICE)
    for name in DIVERGENCES:
        got = _run(t, t.clone(), name, num_splits=num_splits, config=SMALL)
        assert (got == 0).all(), f"{name}: {got}"
        # the same values in another dtype: identical after the float32 upcast
        got = _run(t.half().float(), t.half(), name, num_splits=num_splits, config=SMALL)
        assert (got == 0).all(), f"{name} mixed dtypes: {got}"
        # a constant shift is the same distribution: 0 within rounding
        got = _run(t, t + 3.5, name, num_splits=num_splits, config=SMALL)
        assert (got.abs() <= 1e-5).all(), f"{name} shifted: {got}"


def _edge_rows(vocab=257):
    g = _gen(11)
    t = torch.randn(9, vocab, generator=g)
    d = torch.randn(9, vocab, generator=g)
    t[0, 10:100] = NEG_INF  # target has zeros where draft has mass: KL(q||p) = inf, KL(p||q) finite
    t[1, ::3] = NEG_INF  # same zeros in both: all finite
    d[1, ::3] = NEG_INF
    half = vocab // 2  # disjoint supports: KL = inf, jsd = ln 2, tv = 1, legacy_js = inf
    t[2, half:] = NEG_INF
    d[2, :half] = NEG_INF
    t[3] = 0.0  # one-hot-ish, same token
    t[3, 5] = 60.0
    d[3] = 0.0
    d[3, 5] = 55.0
    d[4] = 0.0  # one-hot-ish, different tokens
    d[4, 200] = 40.0
    t[4] = 0.0
    t[4, 7] = 40.0
    t[5, 17] = NAN  # NaN logit -> NaN row
    d[6, 3] = POS_INF  # +inf logit -> NaN row (as in the reference)
    d[7] = NEG_INF  # no distribution at all -> NaN row
    t[8, [0, -1]] = NEG_INF  # a normal row after the NaN rows (isolation), -inf in the first and the tail tile
    d[8, [0, -1]] = NEG_INF
    return t, d


@pytest.mark.parametrize("dtype,num_splits", [(torch.float32, 1), (torch.bfloat16, 3)])
def test_edge_cases(dtype, num_splits):
    """V=257, BLOCK_V=128: with 3 splits the chunks are 128, 128 and 1 token."""
    t, d = _edge_rows()
    t, d = t.to(DEVICE, dtype), d.to(DEVICE, dtype)
    for name in DIVERGENCES:
        got = _run(t, d, name, num_splits=num_splits, config=SMALL)
        ref = divergence(t, d, name)
        _assert_close(got, ref, f"{name} {dtype} splits={num_splits}")
        assert torch.isnan(got[5:8]).all() and not torch.isnan(got[:5]).any() and torch.isfinite(got[8])
        if name in ("kl_qp", "legacy_js"):
            assert got[0] == POS_INF
        if name in ("kl_qp", "kl_pq", "legacy_js"):
            assert got[2] == POS_INF
        if name == "jsd":
            assert abs(got[2].item() - math.log(2.0)) < 1e-6
        if name in ("jsd_bits", "tv"):
            assert abs(got[2].item() - 1.0) < 1e-6
    assert torch.isfinite(fused_divergence(t, d, "kl_pq", num_splits=num_splits, config=SMALL)[:2]).all()


def test_strides_broadcast_and_shapes():
    g = _gen(5)
    rows, vocab = 3, 500
    wide = torch.randn(rows, vocab + 37, generator=g).to(DEVICE)
    t = wide[:, 11:11 + vocab]  # row stride vocab + 37, offset start
    d = torch.randn(vocab, rows, generator=g).to(DEVICE).t()  # vocab stride = rows, row stride 1
    assert not t.is_contiguous() and d.stride() == (1, rows)
    for name in ("kl_qp", "jsd", "tv"):
        for ns in (1, 2):
            _assert_close(_run(t, d, name, num_splits=ns, config=SMALL), divergence(t, d, name), f"{name} strided")
    # broadcast: one target row (stride 0 after expand) against every draft row
    one = t[:1]
    _assert_close(_run(one, d, "kl_pq"), divergence(one, d, "kl_pq"), "broadcast")
    # (..., V) leading dims and a single row
    t3 = torch.randn(2, 2, 70, generator=g).to(DEVICE)
    d3 = torch.randn(2, 2, 70, generator=g).to(DEVICE)
    _assert_close(_run(t3, d3, "jsd_bits"), divergence(t3, d3, "jsd_bits"), "3-D")
    _assert_close(_run(t3[0, 0], d3[0, 0], "tv"), divergence(t3[0, 0], d3[0, 0], "tv"), "1-D")
    assert fused_divergence(t3[0, 0], d3[0, 0]).shape == ()
    # zero rows: nothing to launch
    assert fused_divergence(t[:0], d[:0], "jsd").shape == (0,)


def test_validation_errors():
    t = torch.randn(2, 40, device=DEVICE)
    with pytest.raises(ValueError, match="unknown divergence"):
        fused_divergence(t, t, "kl")
    with pytest.raises(ValueError, match="shape mismatch.*align_vocab"):
        fused_divergence(t, t[:, :39])
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_divergence(t, torch.randn(3, 40, device=DEVICE))
    with pytest.raises(ValueError, match="empty"):
        fused_divergence(t[:, :0], t[:, :0])
    with pytest.raises(ValueError, match="vocab"):
        fused_divergence(t[0, 0], t[0, 0])
    with pytest.raises(TypeError, match="dtype"):
        fused_divergence(t, t.double())
    with pytest.raises(TypeError, match="dtype"):
        fused_divergence(t.long(), t.long())
    with pytest.raises(TypeError, match="Tensor"):
        fused_divergence(t.tolist(), t)
    with pytest.raises(ValueError, match="device"):
        fused_divergence(t, t.to("meta"))
    with pytest.raises(RuntimeError, match="cannot run"):
        fused_divergence(t.to("meta"), t.to("meta"))
    with pytest.raises(ValueError, match="out must be"):
        fused_divergence(t, t, out=torch.empty(3, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        fused_divergence(t, t, out=torch.empty(2, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="BLOCK_V"):
        fused_divergence(t, t, config={"BLOCK_V": 48})
    assert not fused_divergence_available("meta")


_NO_INTERP = textwrap.dedent("""
    import torch
    from eagle_fsd.kernels import fused_divergence, fused_divergence_available
    assert not fused_divergence_available("cpu")
    try:
        fused_divergence(torch.randn(2, 40), torch.randn(2, 40))
    except RuntimeError as exc:
        assert "TRITON_INTERPRET" in str(exc) and "eagle_fsd.divergence.divergence" in str(exc), exc
        print("OK")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cpu_without_interpreter_raises():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _NO_INTERP], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


_AOT = textwrap.dedent("""
    import importlib, re, sys
    import triton
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        if "nvidia" not in triton.backends.backends:
            raise ImportError("no nvidia backend")
    except Exception as exc:
        print("SKIP", exc); sys.exit(0)
    m = importlib.import_module("eagle_fsd.kernels.divergence")
    ptrs = dict(T="*bf16", D="*bf16", OUT="*fp32", WS="*fp32", PART="*fp32")

    def build(fn, const, num_warps=8):
        sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig[n].startswith("*") or n in ("stride_t", "stride_d", "CHUNK")}
        k = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=num_warps))
        return k.asm["ptx"]

    try:
        unit = dict(BLOCK_V=2048, stride_tv=1, stride_dv=1)
        ptx = [build(m._div_stats_kernel, unit)]
        for name in ("kl_qp", "jsd", "legacy_js"):
            ptx.append(build(m._div_fused_kernel, dict(unit, NAME=name)))
            ptx.append(build(m._div_partial_kernel, dict(unit, NAME=name, S_POW2=16)))
        build(m._div_combine_kernel, dict(NAME="jsd_bits", BLOCK_R=16, S_POW2=16), num_warps=4)
    except triton.compiler.errors.CompilationError:
        raise
    except Exception as exc:
        if "ptxas" in type(exc).__name__.lower():
            raise
        print("SKIP ahead-of-time compile API differs in this triton:", type(exc).__name__, exc); sys.exit(0)
    # full tiles: 16-byte bf16 loads; no local-memory spills
    print("VEC", all(re.search(r"ld\\.global(\\.\\w+)*\\.v4", p) for p in ptx))
    print("SPILL", any(re.search(r"\\.local", p) for p in ptx))
    print("OK")
""")


def test_compiles_for_hopper(tmp_path):
    """Compile (not run) the kernels for sm_90 with Triton's bundled ptxas: catches what the interpreter does not check
    (constexpr globals, loop-carried types, real-compiler dtype rules) and checks the full-tile loads vectorise."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    proc = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=600)
    if "SKIP" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "VEC True" in proc.stdout and "SPILL False" in proc.stdout, proc.stdout
