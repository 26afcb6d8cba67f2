"""The GGUF k-quant kernel (eagle_fsd.kernels.kquant_rows): Q4_K and Q6_K blocks decoded as gguf decodes them, the
kernel against a float64 reference on fresh random inputs, each row independent of its call and of the thread count
(what makes verification equal plain decoding), the AVX2 build giving the AVX-512 build's bits, every code read where
pack puts it, the extreme codes and activations without saturation. Needs a CPU with AVX-512 VNNI or AVX2 and a C++
compiler: elsewhere these tests are reported as skipped.

Each test that guards the kernel names a one-line mutation that makes it fail (each was tried)."""
import ctypes

import gguf
import pytest
import torch

from eagle_fsd.kernels import int4_rows as k4
from eagle_fsd.kernels import kquant_rows as kq

pytestmark = pytest.mark.skipif(not kq.kquant_rows_available(), reason="needs AVX-512 VNNI or AVX2 and a C++ compiler")
ISAS = k4.runnable_isas(k4.cpu_flags(), "")  # every build this CPU runs, uncapped


def raw_from(kind: str, q: torch.Tensor, scale: int, low: int = 0) -> torch.Tensor:
    """Blocks with codes q (n, k), every sub-block scale `scale` (and Q4_K min `low`), d = dmin = 1."""
    n, k = q.shape
    ones = torch.ones(n, k // kq.SUPER, dtype=torch.half)
    if kind == "q4_k":
        return kq.encode_q4k(q, torch.full((n, k // 32), scale), torch.full((n, k // 32), low), ones, ones)
    return kq.encode_q6k(q, torch.full((n, k // 16), scale), ones)


def magnitude(kind: str, raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """a_i sum_j |W_oj| |v_ij| with Q4_K's code and min parts apart: what the fp32 roundings are relative to."""
    if kind == "q4_k":
        q, sc, mn, d, dmin = kq.decode_q4k(raw)
        w = (d.double().repeat_interleave(8, 1) * sc.double()).repeat_interleave(32, 1) * q.double() + \
            (dmin.double().repeat_interleave(8, 1) * mn.double()).repeat_interleave(32, 1)
    else:
        w = kq.dequantize(kind, raw).abs()
    v, a = k4.round_rows(x)
    return (v.double().abs() @ w.T) * a.double()


@pytest.mark.parametrize("kind", kq.KINDS)
def test_decode_is_ggufs_and_encode_inverts_it(kind):
    """gguf computes in fp32: Q6_K's d sc (q - 32) has at most 24 significant bits, so exact, equal to our float64;
    Q4_K's d sc q - dmin mn is one fp32 subtraction of exact products, the float64 difference (exact for these d,
    dmin) rounded once to fp32. So gguf's values equal ours cast to fp32, bit for bit.
    Mutation: decode_q4k's `(s0 >> 6) << 4` as `(s1 >> 6) << 4`; decode_q6k's shifts [0, 2, 4, 6] as [0, 4, 2, 6]."""
    g = torch.Generator().manual_seed(1)
    raw = kq.random_blocks(kind, 37, 768, g)
    assert raw.shape == (37, 3 * kq.BLOCK_BYTES[kind]) and raw.dtype == torch.uint8
    ours = kq.dequantize(kind, raw)
    assert ours.dtype == torch.float64 and ours.shape == (37, 768)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), kq.GGML_TYPES[kind]))
    assert torch.equal(theirs, ours.float())
    parts = kq.decode_q4k(raw) if kind == "q4_k" else kq.decode_q6k(raw.numpy())  # numpy bytes too
    assert torch.equal((kq.encode_q4k if kind == "q4_k" else kq.encode_q6k)(*parts), raw)
    assert int(parts[0].max()) == (15 if kind == "q4_k" else 63) and int(parts[0].min()) == 0


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", kq.KINDS)
@pytest.mark.parametrize("rows", [1, 3, 16, 21])
@pytest.mark.parametrize("out_features, in_features, bias", [(48, 256, False), (40, 512, True), (300, 768, True)])
def test_kernel_matches_float64_reference(rows, out_features, in_features, bias, kind, isa):
    """Mutation: the VNNI Q6_K kernel's `ci[s0 + 2 * f]` as `ci[s0 + f]` (the -32 S of another sub-block), or the
    Q4_K min term's `_mm512_fmsub_ps` as `_mm512_fmadd_ps`."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    raw = kq.random_blocks(kind, out_features, in_features, g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    x[:, 5] *= 30  # an outlier channel
    y = kq.kquant_rows_linear(x, kq.pack(kind, raw), kind, out_features, b, isa=isa)
    want = kq.kquant_rows_reference(x, kind, raw, b)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    # per super-block a few fp32 roundings of its terms, one per addition over super-blocks, one at the end
    scale = magnitude(kind, raw, x) + (0 if b is None else b.double().abs())
    ulps = (in_features // kq.SUPER + 4) * 2.0 ** -24
    assert ((y.double() - want).abs() <= ulps * scale).all()
    # the reference's rows are rounded to 8 bits: it is not the float product, by far more than that tolerance
    float_product = x.double() @ kq.dequantize(kind, raw).T + (0 if b is None else b.double())
    assert ((want - float_product).abs() > 100 * ulps * scale).any()


@pytest.mark.parametrize("kind", kq.KINDS)
def test_each_row_is_independent_of_its_call_and_of_threads(kind):
    """Mutation: round_rows' `float peak = 0.f;` hoisted out of its loop over rows (one peak for the call)."""
    g = torch.Generator().manual_seed(5)
    raw, b = kq.random_blocks(kind, 80, 512, g), torch.randn(80, generator=g)
    packed = kq.pack(kind, raw)
    x = torch.randn(37, 512, generator=g) * torch.logspace(-2, 2, 37).unsqueeze(1)
    alone = torch.cat([kq.kquant_rows_linear(x[i:i + 1], packed, kind, 80, b) for i in range(37)])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for size in (2, 5, 16, 17, 37):
                assert torch.equal(kq.kquant_rows_linear(x[:size], packed, kind, 80, b), alone[:size]), (n, size)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(len(ISAS) < 2, reason="needs a CPU with AVX-512 VNNI to compare the two builds")
@pytest.mark.parametrize("kind", kq.KINDS)
def test_avx2_build_gives_the_avx512_builds_bits(kind):
    """Mutation: the AVX2 Q4_K epilogue's `_mm256_fmsub_ps(d, A, dmin B)` as `_mm256_sub_ps(_mm256_mul_ps(d, A),
    dmin B)` (two roundings where the VNNI build has one)."""
    g = torch.Generator().manual_seed(11)
    for rows, out_features, in_features in ((1, 48, 256), (5, 300, 512), (16, 64, 4096), (23, 1536, 256)):
        raw = kq.random_blocks(kind, out_features, in_features, g)
        b = torch.randn(out_features, generator=g)
        x = torch.randn(rows, in_features, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
        x[:, 7] *= 50  # an outlier channel: the extreme codes +-127 in every row
        packed = kq.pack(kind, raw)
        ys = [kq.kquant_rows_linear(x, packed, kind, out_features, b, isa=isa) for isa in ISAS]
        assert all(torch.equal(y, ys[0]) for y in ys[1:]), (rows, out_features, in_features)


def one_hot_cases(kind: str):
    """(n, channel, column): the first and last lane of a block, the last channel of a padded block (20 = 16 + 4),
    and in super-block 1 one column in every sub-block (Q4_K: 8 of 32, low and high nibbles; Q6_K: 16 of 16, both
    halves), at every place within a chunk of 4."""
    width = 32 if kind == "q4_k" else 16
    columns = [kq.SUPER + width * s + (5 * s) % width for s in range(kq.SUPER // width)]
    return [(20, 19, 3), (32, 31, kq.SUPER - 1), (32, 0, 0), (32, 15, 100)] + \
        [(32, 16 + s % 16, c) for s, c in enumerate(columns)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", kq.KINDS)
def test_pack_puts_each_code_where_the_kernel_reads_it(kind, isa):
    """One nonzero weight at a time (Q4_K code 15, Q6_K code 63 = +31 among codes 32 = 0; scales 1, d 1): rows of
    the identity (row j one-hot at column j) give that weight at its (column, channel) and zero everywhere else.
    Mutation: pack's Q6_K high bits `lanes(blocks[..., 128:192])` as `lanes(blocks[..., 128:192], 2)`, or the VNNI
    Q4_K kernel's `q[4 * h + r]` as `q[4 * r + h]`."""
    k, code, zero = 512, (15 if kind == "q4_k" else 63), (0 if kind == "q4_k" else 32)
    for n, channel, column in one_hot_cases(kind):
        q = torch.full((n, k), zero, dtype=torch.uint8)
        q[channel, column] = code
        y = kq.kquant_rows_linear(torch.eye(k), kq.pack(kind, raw_from(kind, q, 1)), kind, n, isa=isa)
        weight = float(code - zero)
        assert abs(float(y[column, channel]) - weight) <= 1e-6 * weight, (n, channel, column)
        y[column, channel] = 0
        assert not y.any(), (n, channel, column)


@pytest.mark.parametrize("isa", ISAS)
def test_extreme_q6k_codes_and_activations_do_not_saturate(isa):
    """Every Q6_K code 0 or 63, every scale -128 or 127, every activation +-127 (a row of +-127: a = 1): the largest
    int16 pair sums of the AVX2 build (2 x 2 x 63 x 127 = 32004, 16 x 16 x 127 = 32512) and |I| up to 16 x 128 x 16 x
    32 x 127. The products are exact in fp32, so the output is exactly 2 super-blocks x I.
    Mutation: the AVX2 Q6_K kernel adding `first` and `second` in int16 before one `_mm256_madd_epi16`."""
    for code in (0, 63):
        for scale in (-128, 127):
            packed = kq.pack("q6_k", raw_from("q6_k", torch.full((16, 512), code, dtype=torch.uint8), scale))
            for sign in (1.0, -1.0):
                y = kq.kquant_rows_linear(torch.full((1, 512), sign * 127), packed, "q6_k", 16, isa=isa)
                want = 2 * 16 * scale * 16 * (code - 32) * 127 * sign
                assert float(torch.tensor(want, dtype=torch.float32)) == want  # exact in fp32
                assert torch.equal(y, torch.full((1, 16), want)), (code, scale, sign)


@pytest.mark.parametrize("isa", ISAS)
def test_extreme_q4k_codes_and_activations_do_not_saturate(isa):
    """Every Q4_K code 15 or 0, scales and mins 63, activations +-127: A = 8 x 63 x 32 x 15 x 127 and B = 8 x 63 x
    32 x 127 per super-block, the AVX2 build's int16 slots at 8 x 2 x 15 x 127 = 30480. Exact in fp32.
    Mutation: the AVX2 build's `pair2` with its operands swapped (activations read as unsigned bytes)."""
    for code in (15, 0):
        packed = kq.pack("q4_k", raw_from("q4_k", torch.full((16, 512), code, dtype=torch.uint8), 63, 63))
        for sign in (1.0, -1.0):
            y = kq.kquant_rows_linear(torch.full((1, 512), sign * 127), packed, "q4_k", 16, isa=isa)
            want = 2 * (8 * 63 * 32 * code * 127 - 8 * 63 * 32 * 127) * sign
            assert float(torch.tensor(want, dtype=torch.float32)) == want
            assert torch.equal(y, torch.full((1, 16), want)), (code, sign)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", kq.KINDS)
def test_the_c_entry_writes_its_columns_of_a_wider_output(kind, isa):
    """The address decoder_glue calls: rows of y with ldy columns, only [0, 16 blocks) written, the bits of
    kquant_rows_linear. Mutation: rows_into passing `16 * blocks` to the block products for `ldy`."""
    g = torch.Generator().manual_seed(7)
    raw, b = kq.random_blocks(kind, 40, 512, g), torch.randn(48, generator=g)
    packed, x = kq.pack(kind, raw), torch.randn(3, 512, generator=g)
    y = torch.full((3, 53), float("nan"))
    entry = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int64])(kq.kquant_rows_entry(kind, isa))
    entry(x.data_ptr(), 3, 512, packed.data_ptr(), None, None, b.data_ptr(), packed.shape[0], packed.shape[1],
          y.data_ptr(), 53)
    assert torch.equal(y[:, :48], kq.kquant_rows_linear(x, packed, kind, 48, b, isa=isa))
    assert y[:, 48:].isnan().all()
    assert kq.kquant_rows_entry("q4_k", isa) != kq.kquant_rows_entry("q6_k", isa)


def test_pack_shape_and_padding():
    g = torch.Generator().manual_seed(3)
    for kind in kq.KINDS:
        packed = kq.pack(kind, kq.random_blocks(kind, 20, 768, g))
        assert packed.shape == (2, 3, kq.PACKED_BYTES[kind]) and packed.dtype == torch.uint8
    with pytest.raises(ValueError, match="q6_k"):
        kq.pack("q6_k", torch.zeros(4, 100, dtype=torch.uint8))


def test_unavailable_without_avx2(monkeypatch):
    kq.kquant_rows_isa.cache_clear()
    monkeypatch.setattr(kq, "cpu_flags", lambda: {"sse4_2", "fma", "f16c"})
    try:
        assert not kq.kquant_rows_available()
        with pytest.raises(RuntimeError, match="AVX2"):
            kq.kquant_rows_linear(torch.zeros(1, 256), torch.zeros(1, 1, 2368, dtype=torch.uint8), "q4_k", 16)
    finally:
        kq.kquant_rows_isa.cache_clear()
