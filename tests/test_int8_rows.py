"""The int8 x int8 kernel (eagle_fsd.kernels.int8_rows), each build this CPU runs (AVX-512 VNNI with 8-bit
activations, AVX2 with 7-bit ones): against a float64 reference on fresh random inputs, each row independent of its
call and of the thread count, codes packed where the kernel reads them, no saturation at the largest codes, and the
target's int8 layers running it exactly where a build takes their activation bits. A build this CPU lacks (or no C++
compiler) is reported as skipped."""
import pytest
import torch

from eagle_fsd import target_quant
from eagle_fsd.kernels import int8_rows as k8
from eagle_fsd.target_quant import Int8Product, RowQuantLinear


@pytest.fixture(params=[8, 7], ids=["vnni-8bit", "avx2-7bit"])
def bits(request):
    if not k8.int8_rows_runnable(request.param):
        pytest.skip(f"this CPU has no {k8.BUILDS[request.param]} (or no C++ compiler)")
    return request.param


def run(x, q, scale, bias=None, *, bits):
    packed, qsum, padded_scale = k8.pack_int8_rows(q, scale)
    padded_bias = None if bias is None else torch.nn.functional.pad(bias, (0, padded_scale.numel() - bias.numel()))
    return k8.int8_rows_linear(x, packed, qsum, padded_scale, q.shape[0], padded_bias, bits=bits)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("out_features, in_features, bias", [(48, 96, False), (40, 70, True), (300, 161, True)])
def test_kernel_matches_float64_reference(rows, out_features, in_features, bias, bits):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[3] *= 20  # a channel with a wide range
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g) * torch.logspace(-1, 1, rows).unsqueeze(1)
    x[:, 5] *= 30  # an outlier input, as LLM activations have
    q, scale = k8.quantize_int8(w)
    y = run(x, q, scale, b, bits=bits)
    want = k8.int8_rows_reference(x, q, scale, b, bits=bits)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    # P - z Q is an exact integer; then one fp32 product and one fused multiply-add: ulps of the largest term
    v, a = k8.round_rows(x, bits)
    assert v.abs().max() == 2 ** (bits - 1) - 1  # each row's largest |x| takes the largest code
    magnitude = (v.abs().double() @ (q.double().abs() * scale.double().unsqueeze(1)).T) * a.double()
    assert ((y.double() - want).abs() <= 1e-6 * (magnitude + want.abs()) + 1e-7).all()
    # the rounding is real: rounded rows and 8-bit weights, not the float product
    float_product = x.double() @ w.double().T + (0 if b is None else b.double())
    assert (y.double() - float_product).abs().max() > 1e-4


def test_weights_round_per_channel_within_half_a_step():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(33, 50, generator=g) * torch.logspace(-3, 1, 33).unsqueeze(1)
    q, scale = k8.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().amax(1).eq(127).all()  # each channel's largest |W| is the code 127
    assert ((q.double() * scale.double().unsqueeze(1) - w.double()).abs() <= scale.double().unsqueeze(1) * 0.5001).all()


def test_each_row_is_independent_of_its_call_and_of_threads(bits):
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(80, 128, generator=g) * 0.05, torch.randn(80, generator=g)
    q, scale = k8.quantize_int8(w)
    x = torch.randn(37, 128, generator=g) * torch.logspace(-2, 2, 37).unsqueeze(1)
    alone = torch.cat([run(x[i:i + 1], q, scale, b, bits=bits) for i in range(37)])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for size in (2, 3, 4, 5, 8, 17, 37):
                assert torch.equal(run(x[:size], q, scale, b, bits=bits), alone[:size]), (n, size)
    finally:
        torch.set_num_threads(threads)


def test_pack_puts_each_code_where_the_kernel_reads_it(bits):
    """One nonzero code at a time (scales 1): the product with a one-hot row picks exactly that channel and input."""
    n, k = 20, 70
    for channel, column in ((0, 0), (17, 69), (5, 36), (15, 33), (16, 3)):
        q = torch.zeros(n, k, dtype=torch.int8)
        q[channel, column] = -100
        x = torch.zeros(1, k)
        x[0, column] = 2.0
        y = run(x, q, torch.ones(n), bits=bits)
        nonzero = y[0].nonzero().flatten().tolist()
        assert nonzero == [channel], (channel, column)
        assert y[0, channel].item() == pytest.approx(-200.0, rel=1e-6)


def test_largest_codes_do_not_saturate(bits):
    """Every u at its largest against every q = +-127. 7 bits (AVX2): each pair sums to +-2 * 127 * 127, the most 16
    bits hold without saturating (8-bit activations would not fit there: 2 * 255 * 127); 8 bits (VNNI): four
    products of 255 * 127 summed in 32 bits."""
    k = 64
    q = torch.full((16, k), 127, dtype=torch.int8)
    q[8:] = -127
    x = torch.ones(2, k)
    x[1] = -1.0
    y = run(x, q, torch.ones(16), bits=bits)
    # row 0: u - z = r everywhere, a = 1 / r: y = +-127 k; row 1 the negatives
    want = torch.tensor([127.0 * k] * 8 + [-127.0 * k] * 8)
    assert torch.allclose(y, torch.stack([want, -want]), rtol=1e-6, atol=0)


def test_target_layers_run_it_where_a_build_takes_their_bits(monkeypatch, bits):
    """Row-rounded layers run the kernel exactly where int8_rows_available says for their activation bits, and the
    layer equals the kernel's own product; per-call (drafter) layers stay on FBGEMM."""
    g = torch.Generator().manual_seed(9)
    w, b = torch.randn(40, 96, generator=g) * 0.05, torch.randn(40, generator=g)
    x = torch.randn(3, 96, generator=g)
    monkeypatch.setattr(target_quant, "int8_rows_available", lambda asked: asked == bits)
    monkeypatch.setattr(target_quant, "cpu_activation_bits", lambda: 8)  # both widths allowed
    layer = RowQuantLinear.from_weight(w, b, bits)
    assert layer.product.rows_kernel and layer.product.activation_bits == bits
    assert torch.equal(layer(x), run(x, *k8.quantize_int8(w), b, bits=bits))
    assert not Int8Product(w, b, bits, per_row=False).rows_kernel
    assert not Int8Product(w, b, 15 - bits).rows_kernel  # the other width: no build here, FBGEMM
