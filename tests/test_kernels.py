"""Tree-attention kernel tests. Without CUDA they run the Triton kernel on CPU under the interpreter (conftest.py sets
TRITON_INTERPRET=1 before anything imports the kernels); shapes are small to keep the whole file to a few minutes."""

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from eagle_fsd.kernels import (
    is_interpreting,
    kernel_available,
    pack_tree_mask,
    tree_attention,
    tree_attention_reference,
    unpack_tree_mask,
)
from eagle_fsd.eval.gpu_check import ancestor_mask, random_parents, random_tree_mask

# the module itself: the package exports a function of the same name
ta = importlib.import_module("eagle_fsd.kernels.tree_attention")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernel_available(DEVICE), reason="no CUDA and TRITON_INTERPRET!=1 at import")

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # relative to max(1, max|ref|)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(b, hq, hkv, p, n, d, dtype, gen, layout="cache"):
    """q as transformers hands it (transposed view); k/v as non-contiguous views of a bigger buffer."""
    length = p + n

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)

    q = (rnd(b, n, hq, d) * 2.0).transpose(1, 2)
    if layout == "cache":  # preallocated (B, Hkv, Lmax, D) cache, view [:, :, :L]
        k = rnd(b, hkv, length + 13, d)[:, :, :length]
        v = rnd(b, hkv, length + 13, d)[:, :, :length]
    else:  # (B, Lmax, Hkv, D) buffer, transposed view: stride along L is Hkv * D
        k = rnd(b, length + 5, hkv, d)[:, :length].transpose(1, 2)
        v = rnd(b, length + 5, hkv, d)[:, :length].transpose(1, 2)
    return q, k, v


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    err = (out.double() - ref.double()).abs().max().item()
    scale = max(1.0, ref.double().abs().max().item())
    assert err <= TOL[dtype] * scale, f"max abs err {err:.3e} > {TOL[dtype] * scale:.3e}"


def _poisoned(b, n, hq, d, dtype):
    return torch.full((b, n, hq, d), float("nan"), dtype=dtype, device=DEVICE)


# ----------------------------------------------------------------------------------------------------------------------


def test_mode_helpers():
    if not torch.cuda.is_available():
        assert is_interpreting()
    assert kernel_available(DEVICE)
    assert not kernel_available("meta")


@pytest.mark.parametrize("n", [1, 5, 31, 32, 33, 64, 70])
def test_pack_roundtrip(n):
    gen = _gen(n)
    m = torch.rand(3, n, n, generator=gen) < 0.5
    packed = pack_tree_mask(m)
    assert packed.dtype == torch.int32 and packed.shape == (3, n, (n + 31) // 32)
    assert torch.equal(unpack_tree_mask(packed, n), m)
    assert torch.equal(pack_tree_mask(m[0]), packed[:1])
    if n >= 32:  # bit 31 set -> negative int32 word; little bit order
        one = torch.zeros(n, n, dtype=torch.bool)
        one[0, 31] = one[1, 0] = one[2, 1] = True
        w = pack_tree_mask(one)[0]
        assert w[0, 0].item() == -(2**31) and w[1, 0].item() == 1 and w[2, 0].item() == 2


def test_ancestor_mask():
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    m = ancestor_mask(parents)
    assert m[4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    assert m[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert m.diagonal().all()


# (B, Hq, Hkv, P, N, D, dtype, num_splits, kv layout): prefixes not multiples of the block size (32 under the
# interpreter), 0 included; trees 1..64; GQA 1/2/4; fp32/fp16; batch 1/2 with per-batch masks; split-KV on and off.
PARITY = [
    (1, 2, 2, 0, 1, 16, torch.float32, None, "cache"),
    (1, 4, 2, 5, 1, 32, torch.float16, None, "bshd"),
    (1, 4, 1, 0, 5, 16, torch.float32, None, "cache"),
    (2, 4, 2, 37, 17, 32, torch.float16, None, "cache"),
    (1, 2, 1, 19, 33, 16, torch.float32, None, "bshd"),
    (2, 2, 2, 45, 64, 16, torch.float16, None, "cache"),
    (1, 8, 2, 70, 64, 16, torch.float32, 2, "cache"),
    (1, 4, 4, 100, 9, 128, torch.float16, 3, "bshd"),
    (2, 4, 2, 83, 5, 64, torch.float32, 4, "cache"),
    (2, 4, 1, 50, 12, 32, torch.float16, 2, "bshd"),
]


@pytest.mark.parametrize("b,hq,hkv,p,n,d,dtype,splits,layout", PARITY)
def test_parity(b, hq, hkv, p, n, d, dtype, splits, layout):
    gen = _gen(hash((b, hq, hkv, p, n, d)) % 2**31)
    q, k, v = _inputs(b, hq, hkv, p, n, d, dtype, gen, layout)
    mask = random_tree_mask(n, gen, batch=b).to(DEVICE)  # a different random tree per batch element
    out = tree_attention(q, k, v, mask, out=_poisoned(b, n, hq, d, dtype), num_splits=splits)
    _check(out, tree_attention_reference(q, k, v, mask), dtype)


@pytest.mark.parametrize("seed", range(8))
def test_parity_random_sweep(seed):
    """Fresh random shapes, trees, dtypes, layouts and split counts."""
    gen = _gen(1000 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    b, hkv, g = pick([1, 2]), pick([1, 2]), pick([1, 2, 4])
    p, n = int(torch.randint(0, 91, (1,), generator=gen)), int(torch.randint(1, 65, (1,), generator=gen))
    if seed == 0:
        n = 100  # beyond the designed tree size: 4 mask words per row, tile skipping
    d, dtype = pick([16, 32, 64]), pick([torch.float32, torch.float16])
    splits, layout = pick([None, 1, 2, 3]), pick(["cache", "bshd"])
    q, k, v = _inputs(b, hkv * g, hkv, p, n, d, dtype, gen, layout)
    mask = random_tree_mask(n, gen, batch=pick([None, b])).to(DEVICE)
    out = tree_attention(q, k, v, mask, out=_poisoned(b, n, hkv * g, d, dtype), num_splits=splits)
    _check(out, tree_attention_reference(q, k, v, mask), dtype)


def test_bf16_interpreter_upcast():
    gen = _gen(7)
    q, k, v = _inputs(2, 4, 2, 21, 9, 32, torch.bfloat16, gen)
    mask = random_tree_mask(9, gen).to(DEVICE)
    out = tree_attention(q, k, v, mask, out=_poisoned(2, 9, 4, 32, torch.bfloat16))
    _check(out, tree_attention_reference(q, k, v, mask), torch.bfloat16)


def test_packed_and_shared_masks_match():
    gen = _gen(11)
    q, k, v = _inputs(2, 4, 2, 9, 20, 16, torch.float32, gen)
    mask = random_tree_mask(20, gen).to(DEVICE)
    a = tree_attention(q, k, v, mask)  # (N, N), broadcast over the batch
    b = tree_attention(q, k, v, mask.expand(2, 20, 20).contiguous())
    c = tree_attention(q, k, v, pack_tree_mask(mask))  # pre-packed, as the engine should pass it to every layer
    assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(tree_attention_reference(q, k, v, pack_tree_mask(mask)), tree_attention_reference(q, k, v, mask))


def test_split_matches_no_split():
    gen = _gen(12)
    q, k, v = _inputs(1, 4, 2, 77, 6, 32, torch.float32, gen)
    mask = random_tree_mask(6, gen).to(DEVICE)
    one = tree_attention(q, k, v, mask, num_splits=1)
    many = tree_attention(q, k, v, mask, num_splits=5)
    torch.testing.assert_close(one, many, atol=2e-6, rtol=2e-6)


def test_per_branch_property():
    """Each node's output == plain causal attention over prefix + its root-to-node chain (vLLM's test pattern)."""
    b, hq, hkv, p, n, d = 2, 4, 2, 11, 17, 32
    gen = _gen(13)
    q, k, v = _inputs(b, hq, hkv, p, n, d, torch.float32, gen)
    parents = [random_parents(n, gen) for _ in range(b)]
    mask = torch.stack([ancestor_mask(x) for x in parents]).to(DEVICE)
    out = tree_attention(q, k, v, mask, out=_poisoned(b, n, hq, d, torch.float32))
    for bi in range(b):
        for leaf in range(n):
            chain = mask[bi, leaf].nonzero().flatten()  # root .. leaf, ancestors come first (topological order)
            idx = torch.cat([torch.arange(p, device=DEVICE), p + chain])
            kc = k[bi:bi + 1].index_select(2, idx).double()
            vc = v[bi:bi + 1].index_select(2, idx).double()
            qc = q[bi:bi + 1].index_select(2, chain).double()
            c = chain.numel()
            causal = torch.ones(c, p + c, dtype=torch.bool, device=DEVICE)
            causal[:, p:] = torch.tril(torch.ones(c, c, dtype=torch.bool, device=DEVICE))
            ref = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=causal, enable_gqa=True)  # (1, Hq, c, D)
            got = out[bi].index_select(0, chain).transpose(0, 1).double()  # (Hq, c, D)
            torch.testing.assert_close(got, ref[0], atol=2e-5, rtol=2e-5)


def test_causal_prefill_matches_sdpa():
    gen = _gen(14)
    n, hq, hkv, d = 40, 4, 2, 32
    q, k, v = _inputs(1, hq, hkv, 0, n, d, torch.float32, gen)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=DEVICE))
    out = tree_attention(q, k, v, causal, out=_poisoned(1, n, hq, d, torch.float32))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("p", [0, 7])
def test_rows_without_tree_keys_are_finite(p):
    gen = _gen(15 + p)
    n = 6
    q, k, v = _inputs(1, 2, 1, p, n, 16, torch.float32, gen)
    mask = random_tree_mask(n, gen).to(DEVICE)
    mask[3] = False  # node 3 sees no tree key
    out = tree_attention(q, k, v, mask, out=_poisoned(1, n, 2, 16, torch.float32))
    ref = tree_attention_reference(q, k, v, mask)
    _check(out, ref, torch.float32)
    if p == 0:
        assert (out[:, 3] == 0).all()
    else:  # attends to the prefix only
        only_prefix = F.scaled_dot_product_attention(q[:, :, 3:4].double(), k[:, :, :p].double(), v[:, :, :p].double(),
                                                     enable_gqa=True)
        torch.testing.assert_close(out[:, 3:4].double(), only_prefix.transpose(1, 2), atol=2e-5, rtol=2e-5)


def test_custom_scale():
    gen = _gen(16)
    q, k, v = _inputs(1, 2, 2, 10, 4, 16, torch.float32, gen)
    mask = random_tree_mask(4, gen).to(DEVICE)
    _check(tree_attention(q, k, v, mask, scale=0.3), tree_attention_reference(q, k, v, mask, scale=0.3), torch.float32)


def test_autotune_path(monkeypatch):
    """The GPU launch path (triton.autotune + config pruning + grid lambda), driven by a fake benchmarker."""
    import triton

    calls = []

    def fake_bench(fn, quantiles):
        fn()
        calls.append(1)
        return [float(len(calls) % 3 + 1)] * 3

    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=1)
               for bm, bn in ((16, 32), (32, 16), (64, 16), (128, 32))]
    monkeypatch.setattr(ta, "_autotuned", ta._make_autotuned(configs, do_bench=fake_bench))
    gen = _gen(17)
    # fp16 (float32 is never autotuned); M = 17 * 2 = 34 -> M_CAP 64: BLOCK_M 16 and 128 are pruned
    q, k, v = _inputs(1, 4, 2, 19, 17, 16, torch.float16, gen)
    mask = random_tree_mask(17, gen).to(DEVICE)
    for splits in (None, 2):
        out = tree_attention(q, k, v, mask, out=_poisoned(1, 17, 4, 16, torch.float16), num_splits=splits)
        _check(out, tree_attention_reference(q, k, v, mask), torch.float16)
    assert len(calls) == 4  # BLOCK_M 32 and 64 survive pruning, benchmarked once per key (SPLIT False / True)
    assert ta._autotuned.best_config.kwargs["BLOCK_M"] in (32, 64)
    assert ta.last_launch[0] == 2 and ta.last_launch[2]


def test_input_validation():
    gen = _gen(18)
    q, k, v = _inputs(1, 4, 2, 3, 5, 16, torch.float32, gen)
    mask = random_tree_mask(5, gen).to(DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(q[:, :3], k, v, mask)
    with pytest.raises(ValueError, match="k and v"):
        tree_attention(q, k, v[:, :, :-1], mask)
    with pytest.raises(ValueError, match="smaller than the number of tree tokens"):
        tree_attention(q, k[:, :, :4], v[:, :, :4], mask)
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention(q, k, v, mask[:4, :4])
    with pytest.raises(ValueError, match="batch"):
        tree_attention(q, k, v, mask.expand(3, 5, 5))
    with pytest.raises(TypeError, match="bool"):
        tree_attention(q, k, v, mask.float())
    with pytest.raises(TypeError, match="dtype"):
        tree_attention(q, k.half(), v.half(), mask)
    with pytest.raises(ValueError, match="head_dim"):
        qq, kk, vv = _inputs(1, 2, 2, 3, 5, 24, torch.float32, gen)
        tree_attention(qq, kk, vv, mask)
    with pytest.raises(ValueError, match="head_dim"):
        qq, kk, vv = _inputs(1, 2, 2, 3, 5, 8, torch.float32, gen)
        tree_attention(qq, kk, vv, mask)
    with pytest.raises(ValueError, match="device"):
        tree_attention(q, k, v, mask.to("meta"))
    with pytest.raises(ValueError, match="out must be"):
        tree_attention(q, k, v, mask, out=torch.empty(1, 5, 4, 16, dtype=torch.float16, device=DEVICE))


def test_gpu_check_toy(tmp_path):
    """`python -m eagle_fsd.eval.gpu_check --toy` runs end to end (CPU: under the interpreter) and writes results."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", "eagle_fsd.eval.gpu_check", "--toy", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["parity_ok"] and res["parity"] and all(r["ok"] for r in res["parity"])
    assert res["timing"] and all(r["tree_us"] > 0 for r in res["timing"])
    assert "fused_divergence" in res
    assert (tmp_path / "gpu_check_table.txt").exists()


_AOT = textwrap.dedent("""
    import importlib, sys
    import triton
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        if "nvidia" not in triton.backends.backends:
            raise ImportError("no nvidia backend")
    except Exception as exc:
        print("SKIP", exc); sys.exit(0)
    ta = importlib.import_module("eagle_fsd.kernels.tree_attention")
    fn = ta._tree_attn_fwd
    const = dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, M_CAP=64, SPLIT=True, UPCAST=False, IEEE=False)
    sig = {}
    for n in fn.arg_names:
        if n in ("Q", "K", "V", "OUT"): sig[n] = "*bf16"
        elif n in ("WS_O", "WS_LSE"): sig[n] = "*fp32"
        elif n == "MASK": sig[n] = "*i32"
        elif n == "qk_scale": sig[n] = "fp32"
        elif n in const: sig[n] = "constexpr"
        else: sig[n] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (n.startswith("stride") and n != "stride_mb")}
    from triton.compiler.errors import CompilationError
    try:
        k = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4, num_stages=3))
        print("WGMMA", "warp_group_dot" in k.asm["ttgir"])
        c = triton.compile(ASTSource(ta._tree_attn_combine,
                                     dict(WS_O="*fp32", WS_LSE="*fp32", OUT="*bf16", R_TOTAL="i32", S="i32",
                                          HEAD_DIM="constexpr", BLOCK_R="constexpr"),
                                     constexprs=dict(HEAD_DIM=128, BLOCK_R=16)),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    except CompilationError:
        raise
    except Exception as exc:
        if "ptxas" in type(exc).__name__.lower():
            raise
        print("SKIP ahead-of-time compile API differs in this triton:", type(exc).__name__, exc); sys.exit(0)
    print("OK")
""")


def test_compiles_for_hopper(tmp_path):
    """Compile (not run) the kernels for sm_90 with Triton's bundled ptxas: catches what the interpreter does not check
    (non-constexpr globals, dtype/shape rules of the real compiler). Needs no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    proc = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=600)
    if "SKIP" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "WGMMA True" in proc.stdout  # Hopper tensor-core path, not a fallback


def test_kernels_import_nothing_of_eagle_fsd():
    """kernels/ is the bottom layer: only relative imports inside the package, torch and triton."""
    import ast
    import pathlib

    kernels_dir = pathlib.Path(importlib.import_module("eagle_fsd.kernels").__file__).parent
    files = sorted(kernels_dir.glob("*.py"))
    assert len(files) >= 5
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("eagle_fsd") for a in node.names), path
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not node.module.startswith("eagle_fsd"), (path, node.module)
