"""Tests for eagle_fsd.divergence against a float64 NumPy reference."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from eagle_fsd.divergence import DEFAULT_TOP_K, DIVERGENCES, align_vocab, divergence, kl_qp_on_support

NEG_INF = float("-inf")
NAN = float("nan")
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- float64 NumPy reference


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    mx = np.max(x, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        z = x - mx
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def np_kl(la: np.ndarray, lb: np.ndarray) -> np.ndarray:
    """KL(a‖b) = Σ a (ln a − ln b) from log-probs; terms with a == 0 are 0, a > 0 with b == 0 is +inf."""
    a = np.exp(la)
    with np.errstate(invalid="ignore"):
        t = np.where(a > 0, a * (la - lb), 0.0)
    return t.sum(axis=-1)


def np_ref(name: str, lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
    """Reference divergences from float64 log-probs lp (target), lq (draft)."""
    p, q = np.exp(lp), np.exp(lq)
    lm = np.logaddexp(lp, lq) - LN2  # m = (p + q) / 2
    if name == "kl_qp":
        return np_kl(lq, lp)
    if name == "kl_pq":
        return np_kl(lp, lq)
    if name == "jsd":
        return 0.5 * np_kl(lp, lm) + 0.5 * np_kl(lq, lm)
    if name == "jsd_bits":
        return (0.5 * np_kl(lp, lm) + 0.5 * np_kl(lq, lm)) / LN2
    if name == "tv":
        return 0.5 * np.abs(p - q).sum(axis=-1)
    if name == "legacy_js":
        return 0.5 * np_kl(lm, lp) + 0.5 * np_kl(lm, lq)
    raise AssertionError(name)


def np_bucket(lp: np.ndarray, lq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Target's top-k ids, then one rest bucket = 1 - sum(top-k mass) per distribution (log-probs)."""
    p, q = np.exp(lp), np.exp(lq)
    idx = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    pk = np.take_along_axis(p, idx, axis=-1)
    qk = np.take_along_axis(q, idx, axis=-1)
    rp = np.clip(1.0 - pk.sum(-1, keepdims=True), 0.0, None)
    rq = np.clip(1.0 - qk.sum(-1, keepdims=True), 0.0, None)
    with np.errstate(divide="ignore"):
        return np.log(np.concatenate([pk, rp], -1)), np.log(np.concatenate([qk, rq], -1))


def ref(name: str, t: torch.Tensor, d: torch.Tensor, top_k: int | None = None) -> np.ndarray:
    """Reference computed in float64 from the *same* (possibly low-precision) input values."""
    lp = np_log_softmax(t.double().numpy())
    lq = np_log_softmax(d.double().numpy())
    if top_k is not None:
        lp, lq = np_bucket(lp, lq, top_k)
    return np_ref(name, lp, lq)


def check(out: torch.Tensor, expected: np.ndarray, rtol=2e-4, atol=2e-6):
    assert out.dtype == torch.float32
    assert tuple(out.shape) == expected.shape
    np.testing.assert_allclose(out.numpy().astype(np.float64), expected, rtol=rtol, atol=atol)


def rand_pair(shape, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    d = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    return t, d


# ----------------------------------------------------------------------------- random inputs vs reference


SHAPES = [(2,), (3, 2), (4, 7), (2, 3, 33), (5, 257), (3, 1000)]


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_numpy_reference(name, shape, dtype):
    t, d = rand_pair(shape, dtype, seed=zlib.crc32(f"{name}{shape}".encode()) % 1000)
    check(divergence(t, d, name), ref(name, t, d))


@pytest.mark.parametrize("name", DIVERGENCES)
def test_close_distributions_small_values(name):
    # Small divergences: absolute accuracy matters (thresholds like T=0.01 must be meaningful).
    t, _ = rand_pair((4, 500), seed=1)
    d = t + 0.05 * torch.randn(4, 500, generator=torch.Generator().manual_seed(2))
    check(divergence(t, d, name), ref(name, t, d), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("name", DIVERGENCES)
def test_logits_and_logprobs_give_same_result(name):
    t, d = rand_pair((3, 100), seed=3)
    a = divergence(t, d, name)
    b = divergence(torch.log_softmax(t, -1), torch.log_softmax(d, -1) + 7.0, name)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", DIVERGENCES)
def test_broadcast_leading_dims(name):
    t, _ = rand_pair((1, 50), seed=4)
    _, d = rand_pair((6, 50), seed=5)
    out = divergence(t, d, name)
    assert out.shape == (6,)
    check(out, ref(name, t.expand(6, 50), d))


def test_default_name_is_kl_qp():
    t, d = rand_pair((2, 10), seed=6)
    torch.testing.assert_close(divergence(t, d), divergence(t, d, "kl_qp"))


def test_float64_input_returns_float32():
    t, d = rand_pair((2, 10), torch.float64, seed=7)
    out = divergence(t, d, "jsd")
    assert out.dtype == torch.float32
    check(out, ref("jsd", t, d))


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("top_k", [None, 3])
def test_identical_is_zero(name, top_k):
    t, _ = rand_pair((4, 200), seed=8)
    t[0, :50] = NEG_INF  # zeros in both
    out = divergence(t, t.clone(), name, top_k=top_k)
    assert torch.all(out == 0), out


DISJOINT_EXPECTED = {
    "kl_qp": math.inf,
    "kl_pq": math.inf,
    "jsd": LN2,
    "jsd_bits": 1.0,
    "tv": 1.0,
    "legacy_js": math.inf,
}


@pytest.mark.parametrize("name", DIVERGENCES)
def test_disjoint_supports(name):
    t = torch.tensor([[0.0, 1.0, NEG_INF, NEG_INF], [5.0, NEG_INF, NEG_INF, NEG_INF]])
    d = torch.tensor([[NEG_INF, NEG_INF, 2.0, 0.0], [NEG_INF, NEG_INF, NEG_INF, 5.0]])
    out = divergence(t, d, name)
    assert not torch.isnan(out).any()
    exp = DISJOINT_EXPECTED[name]
    if math.isinf(exp):
        assert torch.all(torch.isposinf(out))
    else:
        torch.testing.assert_close(out, torch.full((2,), exp), rtol=1e-6, atol=1e-6)
    check(out, ref(name, t, d))


@pytest.mark.parametrize("name", DIVERGENCES)
def test_zeros_in_distributions(name):
    t, d = rand_pair((6, 40), seed=9)
    t[0, :10] = NEG_INF  # p has zeros, q full support -> KL(p||q) finite, KL(q||p) inf
    d[1, :10] = NEG_INF  # q has zeros -> KL(q||p) finite, KL(p||q) inf
    t[2, :10] = NEG_INF  # shared zeros: 0*log0 terms must be 0, not NaN
    d[2, :10] = NEG_INF
    d[3, 5:] = NEG_INF  # q's support strictly inside p's
    t[4, 20:] = NEG_INF  # partial overlap
    d[4, :10] = NEG_INF
    t[5, :] = torch.linspace(-1, 1, 40)
    t[5, 0] = NEG_INF
    d[5, 39] = NEG_INF
    out = divergence(t, d, name)
    assert not torch.isnan(out).any(), out
    check(out, ref(name, t, d))
    if name == "kl_qp":
        assert torch.isfinite(out[[1, 2, 3]]).all() and torch.isposinf(out[[0, 4, 5]]).all()
    if name == "kl_pq":
        assert torch.isfinite(out[[0, 2]]).all() and torch.isposinf(out[[1, 3, 4, 5]]).all()
    if name in ("jsd", "jsd_bits", "tv"):
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", DIVERGENCES)
def test_one_hot(name):
    V = 30
    onehot = torch.full((V,), NEG_INF)
    onehot[7] = 0.0
    other = torch.full((V,), NEG_INF)
    other[8] = 0.0
    soft, _ = rand_pair((V,), seed=10)
    # same one-hot -> 0
    assert divergence(onehot, onehot.clone(), name).item() == 0.0
    # different one-hots -> disjoint
    out = divergence(onehot, other, name)
    assert out.item() == DISJOINT_EXPECTED[name] or abs(out.item() - DISJOINT_EXPECTED[name]) < 1e-6
    # one-hot vs soft, both orders
    for t, d in ((onehot, soft), (soft, onehot)):
        check(divergence(t, d, name), ref(name, t, d))
    # also a one-hot given as huge finite logits
    big = torch.zeros(V)
    big[7] = 1e4
    out = divergence(big, soft, name)
    check(out, ref(name, big, soft))
    if name in ("kl_qp", "legacy_js"):
        assert torch.isfinite(out) and out.item() > 1000  # p is tiny but not zero: large, finite
    else:
        check(out, ref(name, onehot, soft))


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("top_k", [None, 4])
@pytest.mark.parametrize("where", ["target", "draft"])
@pytest.mark.parametrize("bad", [NAN, math.inf, "all_neg_inf"])
def test_bad_row_gives_nan_others_unaffected(name, top_k, where, bad):
    t, d = rand_pair((4, 20), seed=11)
    t[2, :5] = NEG_INF
    clean = divergence(t, d, name, top_k=top_k)
    x = t if where == "target" else d
    if bad == "all_neg_inf":
        x[1, :] = NEG_INF
    else:
        x[1, 3] = bad
    out = divergence(t, d, name, top_k=top_k)
    assert torch.isnan(out[1])
    keep = [0, 2, 3]
    torch.testing.assert_close(out[keep], clean[keep], rtol=0, atol=0)
    assert not (out[1] <= 1e9)  # a caller's threshold test rejects NaN


# ----------------------------------------------------------------------------- properties


def test_legacy_js_ge_jsd():
    for seed in range(5):
        t, d = rand_pair((50, 64), seed=seed, scale=1.0 + seed)
        legacy = divergence(t, d, "legacy_js")
        jsd = divergence(t, d, "jsd")
        assert torch.all(legacy >= jsd - 1e-6)
        assert torch.all(legacy > jsd)  # strictly larger on non-identical inputs


@pytest.mark.parametrize("name", ["jsd", "jsd_bits", "tv"])
def test_symmetric(name):
    t, d = rand_pair((20, 300), seed=12)
    t[0, :100] = NEG_INF
    torch.testing.assert_close(divergence(t, d, name), divergence(d, t, name), rtol=1e-5, atol=1e-6)


def test_kl_asymmetry_and_directions():
    # p = target, q = draft. KL(q||p) = Σ q ln(q/p); KL(p||q) = Σ p ln(p/q).
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.25, 0.25, 0.5])
    t, d = p.log(), q.log()
    kl_qp = divergence(t, d, "kl_qp").item()
    kl_pq = divergence(t, d, "kl_pq").item()
    assert math.isinf(kl_qp)  # q puts mass where p has none
    assert kl_pq == pytest.approx(math.log(2.0), rel=1e-6)  # Σ 0.5 ln(0.5/0.25)
    # and a finite-finite example where the two directions differ
    p = torch.tensor([0.9, 0.1])
    q = torch.tensor([0.5, 0.5])
    a = divergence(p.log(), q.log(), "kl_qp").item()
    b = divergence(p.log(), q.log(), "kl_pq").item()
    assert a == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-5)
    assert b == pytest.approx(0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5), rel=1e-5)
    assert abs(a - b) > 0.1
    # swapping arguments swaps directions
    torch.testing.assert_close(divergence(q.log(), p.log(), "kl_qp"), divergence(p.log(), q.log(), "kl_pq"))


@pytest.mark.parametrize("kl", ["kl_qp", "kl_pq"])
def test_pinsker(kl):
    for seed in range(5):
        t, d = rand_pair((100, 50), seed=seed, scale=0.5 + seed)
        tv = divergence(t, d, "tv")
        k = divergence(t, d, kl)
        assert torch.all(tv <= torch.sqrt(k / 2) + 1e-6)


def test_jsd_bits_range_and_relation():
    t, d = rand_pair((200, 30), seed=13, scale=5.0)
    t[:50, :15] = NEG_INF
    d[25:75, 15:] = NEG_INF  # rows 25..49 disjoint -> exactly 1 bit
    bits = divergence(t, d, "jsd_bits")
    assert torch.all(bits >= 0) and torch.all(bits <= 1)
    torch.testing.assert_close(bits[25:50], torch.ones(25), rtol=0, atol=1e-6)
    torch.testing.assert_close(bits, divergence(t, d, "jsd") / LN2, rtol=1e-6, atol=1e-7)
    tv = divergence(t, d, "tv")
    assert torch.all((tv >= 0) & (tv <= 1))


# ----------------------------------------------------------------------------- top-k variants


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("V", [2, 17, 128])
def test_top_k_equals_full_when_k_is_v(name, V):
    t, d = rand_pair((5, V), seed=V)
    full = divergence(t, d, name)
    torch.testing.assert_close(divergence(t, d, name, top_k=V), full, rtol=1e-5, atol=1e-6)
    # K > V behaves as K = V
    torch.testing.assert_close(divergence(t, d, name, top_k=V + 10), full, rtol=1e-5, atol=1e-6)


def test_top_k_rest_bucket_empty_keeps_finite_kl():
    # K = V and q has zeros exactly where p has zeros: a rounding-level rest mass must not create +inf.
    t, d = rand_pair((4, 64), seed=14)
    t[:, :8] = NEG_INF
    d[:, :8] = NEG_INF
    for name in ("kl_qp", "kl_pq", "legacy_js"):
        out = divergence(t, d, name, top_k=64)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, divergence(t, d, name), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("shape,k", [((3, 2), 1), ((4, 30), 5), ((2, 3, 200), 50), ((3, 1000), 1), ((2, 1000), 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_matches_bucketed_reference(name, shape, k, dtype):
    _, d = rand_pair(shape, dtype, seed=k + shape[-1])
    # Target logits without ties (bf16 random logits tie often; a tie at the top-k boundary makes the
    # bucketed quantity depend on tie-breaking, which is unspecified).
    pool = torch.linspace(-6, 6, 100_000).to(dtype).unique()
    g = torch.Generator().manual_seed(k)
    rows = [pool[torch.randperm(len(pool), generator=g)[: shape[-1]]] for _ in range(math.prod(shape[:-1]))]
    t = torch.stack(rows).reshape(shape)
    check(divergence(t, d, name, top_k=k), ref(name, t, d, top_k=k))


def test_top_k_uses_target_top_ids_and_rest_mass():
    p = torch.tensor([0.1, 0.6, 0.3])
    q = torch.tensor([0.5, 0.2, 0.3])
    # K=1 -> target's top id is 1: buckets p'=(0.6, 0.4), q'=(0.2, 0.8)
    expected = 0.5 * (abs(0.6 - 0.2) + abs(0.4 - 0.8))
    assert divergence(p.log(), q.log(), "tv", top_k=1).item() == pytest.approx(expected, rel=1e-6)
    kl = 0.2 * math.log(0.2 / 0.6) + 0.8 * math.log(0.8 / 0.4)
    assert divergence(p.log(), q.log(), "kl_qp", top_k=1).item() == pytest.approx(kl, rel=1e-5)


def test_top_k_coarse_graining_never_increases():
    # Data-processing inequality: bucketing cannot increase any of these f-divergences.
    t, d = rand_pair((30, 200), seed=15)
    for name in DIVERGENCES:
        full = divergence(t, d, name)
        topk = divergence(t, d, name, top_k=DEFAULT_TOP_K)
        assert torch.all(topk <= full + 1e-5), name


# ----------------------------------------------------------------------------- errors and vocab alignment


def test_divergences_tuple():
    assert set(DIVERGENCES) == {"kl_qp", "kl_pq", "jsd", "jsd_bits", "tv", "legacy_js"}
    assert isinstance(DIVERGENCES, tuple)


def test_unknown_name():
    t, d = rand_pair((2, 5))
    with pytest.raises(ValueError) as e:
        divergence(t, d, "js_div")
    msg = str(e.value)
    assert "js_div" in msg
    for n in DIVERGENCES:
        assert n in msg


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_top_k(bad):
    t, d = rand_pair((2, 5))
    with pytest.raises(ValueError, match="top_k"):
        divergence(t, d, "tv", top_k=bad)


def test_mismatched_vocab():
    t = torch.randn(2, 10)
    d = torch.randn(2, 12)
    with pytest.raises(ValueError) as e:
        divergence(t, d, "kl_qp")
    assert "10" in str(e.value) and "12" in str(e.value) and "align_vocab" in str(e.value)


def test_non_broadcastable_and_empty_inputs():
    with pytest.raises(ValueError):
        divergence(torch.randn(2, 5), torch.randn(3, 5))
    with pytest.raises(ValueError):
        divergence(torch.randn(2, 0), torch.randn(2, 0))
    with pytest.raises(ValueError):
        divergence(torch.tensor(1.0), torch.tensor(1.0))


def test_align_vocab_padding():
    # e.g. Qwen2.5-0.5B (151936) vs 7B (152064) padding, scaled down
    t = torch.randn(2, 3, 20)
    d = torch.randn(2, 3, 24)
    d[..., 16:] = 100.0  # padding columns must be dropped
    ta, da = align_vocab(t, d, 16)
    assert ta.shape == da.shape == (2, 3, 16)
    torch.testing.assert_close(ta, t[..., :16])
    torch.testing.assert_close(da, d[..., :16])
    out = divergence(ta, da, "jsd")
    assert out.shape == (2, 3)
    check(out, ref("jsd", t[..., :16], d[..., :16]))
    # equal sizes at vocab_size: unchanged
    ta, da = align_vocab(t, d[..., :20], 20)
    assert ta.shape == da.shape == (2, 3, 20)


def test_align_vocab_bad():
    t = torch.randn(2, 20)
    d = torch.randn(2, 12)
    with pytest.raises(ValueError) as e:
        align_vocab(t, d, 16)
    msg = str(e.value)
    assert "20" in msg and "12" in msg and "vocab_size" in msg
    with pytest.raises(ValueError):
        align_vocab(t, d, 0)


# ----------------------------------------------------------------------------- q on a subset of the vocabulary


def scatter_onto(draft: torch.Tensor, support: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits over `vocab` ids: the given columns at `support`, -inf (q = 0) everywhere else."""
    full = draft.new_full((*draft.shape[:-1], vocab), NEG_INF)
    return full.index_copy(-1, support, draft)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_qp_on_support_equals_the_full_vocabulary_divergence(seed):
    """Σ over S of q (ln q - ln p) with ln p's normaliser over all V: the full-vocabulary KL(q||p) of q scattered
    onto V, and the float64 reference, on fresh random rows (some target logits -inf off and on S)."""
    g = torch.Generator().manual_seed(seed)
    vocab, size = 700, 150
    support = torch.randperm(vocab, generator=g)[:size]
    target = torch.randn(5, vocab, generator=g) * 3
    draft = torch.randn(5, size, generator=g) * 3
    target[1, torch.randperm(vocab, generator=g)[:200]] = NEG_INF  # p excludes some ids...
    target[1, support] = torch.randn(size, generator=g)  # ...but none of S
    out = kl_qp_on_support(target, draft, support)
    full = scatter_onto(draft, support, vocab)
    torch.testing.assert_close(out, divergence(target, full, "kl_qp"), rtol=1e-5, atol=1e-6)
    check(out, ref("kl_qp", target, full), rtol=1e-5, atol=1e-6)


def test_kl_qp_on_support_edge_rows():
    """+inf where q > 0 on an id p excludes; NaN for a NaN, +inf or all -inf target row and an all -inf draft
    row, each in its own row only; q = p on S (p 0 elsewhere) gives 0."""
    vocab = 40
    support = torch.arange(3, 23)
    target = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5))
    draft = torch.randn(6, support.numel(), generator=torch.Generator().manual_seed(6))
    target[0, support[4]] = NEG_INF  # q > 0 where p = 0
    target[1, 0] = NAN
    target[2, 30] = math.inf  # outside S: still no distribution
    target[3] = NEG_INF
    draft[4] = NEG_INF
    target[5] = NEG_INF
    target[5, support] = draft[5]
    out = kl_qp_on_support(target, draft, support)
    assert out[0] == math.inf
    assert torch.isnan(out[1:5]).all()
    assert out[5].item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="support holds 19 ids for 20 draft columns"):
        kl_qp_on_support(target, draft, support[:-1])
