"""The 4-bit target kernel (eagle_fsd.kernels.int4_rows) and 4-bit targets (eagle_fsd.target_quant four_bit):
against a float64 reference on fresh random inputs, each row independent of its call and of the thread count (what
makes verification equal plain decoding), 4-bit weights recognised and kept exactly, lossless speculation on a
4-bit target; the AVX2 build giving the AVX-512 build's bits. Needs a CPU with AVX-512 VNNI or AVX2 and a C++
compiler: elsewhere these tests are reported as skipped."""
import pytest
import torch
from torch import nn

from eagle_fsd.drafting import LMDrafter
from eagle_fsd.kernels import int4_rows as k4
from eagle_fsd.loading import model_run
from eagle_fsd.plan import WeightFormat
from eagle_fsd.target_quant import (Int4Product, Int8Product, RowQuantLinear, SharedInputProduct, int4_share,
                                    own_product)
from eagle_fsd.weights import format_weights
from tiny import assert_speculation_is_plain_greedy, tiny_model

pytestmark = pytest.mark.skipif(not k4.int4_rows_available(), reason="needs AVX-512 VNNI or AVX2 and a C++ compiler")
ISAS = k4.runnable_isas(k4.cpu_flags(), "")  # every build this CPU runs, uncapped


FOUR_BIT = WeightFormat("rows", four_bit=True)  # a target whose 4-bit layers run int4 x int8, the others int8 x int8


def weights_label(model, fmt: WeightFormat) -> str:
    """How the loader's plan describes a target's linear layers in `fmt` (eagle_fsd.plan.ModelRun.label)."""
    return model_run(model, fmt, "auto", exact=True, decoder=True).label()


def four_bit(weight: torch.Tensor) -> torch.Tensor:
    """A weight whose groups of 32 hold at most 16 values: a GGUF Q4 tensor, dequantized."""
    return k4.dequantize_int4(*k4.quantize_int4(weight)).float()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 3, 16, 21])
@pytest.mark.parametrize("out_features, bias", [(48, False), (40, True), (300, True)])
@pytest.mark.parametrize("group, k", [(32, 96), (128, 384)])  # a target's groups; a drafter's coarser ones
def test_kernel_matches_float64_reference(rows, out_features, bias, isa, group, k):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, k, generator=g) * 0.05
    w[3, 40:50] *= 20  # a group with a wide range
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    x[:, 5] *= 30  # an outlier channel
    q, s, m = k4.quantize_int4(w, group)
    assert s.shape == m.shape == (out_features, 3)
    y = k4.int4_rows_linear(x, k4.pack_int4(q, s, m), out_features, b, isa=isa)
    want = k4.int4_rows_reference(x, q, s, m, b)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    # fp32 sums of 3 groups of exact int32 products: a few ulps of the largest term
    scale = (x.abs().amax(1, keepdim=True).double() / 127) * (k4.dequantize_int4(q, s, m).abs() @
                                                               torch.full((k, 1), 127.0, dtype=torch.float64)).T
    assert ((y.double() - want).abs() <= 1e-6 * scale + 1e-6).all()
    # the rounding is real: 8-bit rows and 4-bit weights, not the float product
    float_product = x.double() @ w.double().T + (0 if b is None else b.double())
    assert (y.double() - float_product).abs().max() > 1e-4


@pytest.mark.parametrize("isa", ISAS)
def test_each_row_is_independent_of_its_call_and_of_threads(isa):
    # one and two rows take the kernel's fixed-count path, more its general one: every count gives the same bits
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(80, 128, generator=g) * 0.05, torch.randn(80, generator=g)
    packed = k4.pack_int4(*k4.quantize_int4(w))
    x = torch.randn(37, 128, generator=g) * torch.logspace(-2, 2, 37).unsqueeze(1)
    alone = torch.cat([k4.int4_rows_linear(x[i:i + 1], packed, 80, b, isa=isa) for i in range(37)])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for size in (2, 3, 5, 16, 17, 18, 37):
                assert torch.equal(k4.int4_rows_linear(x[:size], packed, 80, b, isa=isa), alone[:size]), (n, size)
    finally:
        torch.set_num_threads(threads)


def test_four_bit_weights_are_recognised_and_kept_exactly():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g) * 0.02
    assert not k4.fits_int4(w) and not k4.fits_int4(w[:, :80])  # 32 values a group; 80 inputs: no whole groups
    w4 = four_bit(w)
    assert k4.fits_int4(w4)
    q, s, m = k4.quantize_int4(w4)
    assert torch.equal(k4.dequantize_int4(q, s, m).float(), w4)  # rounding it again changes nothing
    assert q.max() == 15 and q.min() == 0
    rounded = k4.dequantize_int4(*k4.quantize_int4(w)).float()
    group_step = (w.reshape(64, 3, 32).amax(2) - w.reshape(64, 3, 32).amin(2)) / 15
    assert ((rounded - w).abs().reshape(64, 3, 32) <= group_step.unsqueeze(2) * 0.51 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_pack_puts_each_code_where_the_kernel_reads_it(group):
    """One nonzero code at a time, weight 1 everywhere else 0 (s = 1, m = 0): the product with a one-hot row picks
    exactly that channel and input, in every part of 32 inputs of a coarser group."""
    n, k = 20, 256
    for channel, column in ((0, 0), (17, 63), (5, 36), (15, 33), (3, 100), (19, 255), (8, 130)):
        q = torch.zeros(n, k, dtype=torch.uint8)
        q[channel, column] = 15
        s, m = torch.ones(n, k // group, dtype=torch.half), torch.zeros(n, k // group, dtype=torch.half)
        x = torch.zeros(1, k)
        x[0, column] = 1.0
        y = k4.int4_rows_linear(x, k4.pack_int4(q, s, m), n)
        want = torch.zeros(1, n)
        want[0, channel] = 15.0
        assert torch.equal(y, want), (channel, column)


def test_four_bit_rows_run_four_bit_layers_in_int4_and_the_rest_in_int8():
    model = tiny_model("qwen2", seed=3)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("v_proj"):
                module.weight.copy_(four_bit(module.weight))
    format_weights(model, FOUR_BIT)
    products = {name: m.product for name, m in model.named_modules() if isinstance(m, RowQuantLinear)}
    inner = {name: getattr(p, "product", p) for name, p in products.items()}
    assert all(isinstance(p, Int8Product) for name, p in inner.items() if name.endswith("v_proj"))
    assert all(isinstance(p, Int4Product) for name, p in inner.items() if not name.endswith("v_proj")
               and not name.endswith("lm_head"))  # a tied lm_head is the embedding: not rounded, int8
    assert attention.q_proj.product is attention.k_proj.product and attention.v_proj.product is not attention.q_proj.product
    assert isinstance(attention.q_proj.product, SharedInputProduct)
    assert 0 < int4_share(model) < 1 and weights_label(model, FOUR_BIT).startswith("int4 x int8")
    plain = tiny_model("qwen2", seed=3)
    format_weights(plain, WeightFormat("rows"))  # four_bit off: all int8
    assert int4_share(plain) == 0 and weights_label(plain, WeightFormat("rows")) == "int8 x int8"


def test_a_cpu_without_vnni_runs_int4_beside_7_bit_int8_layers():
    # int8 layers take 7-bit activations there (FBGEMM's 16-bit pair sums); the int4 kernel's own stay 8-bit
    model = tiny_model("qwen2", seed=4)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(four_bit(module.weight))
    format_weights(model, WeightFormat("rows", activation_bits=7, four_bit=True))
    inner = [own_product(m.product) for m in model.modules() if isinstance(m, RowQuantLinear)]
    assert any(isinstance(p, Int4Product) for p in inner)
    assert all(p.activation_bits == 7 for p in inner if isinstance(p, Int8Product))


@pytest.mark.parametrize("shape", [(12, 3, 3), (8, 7, 1)])
def test_engine_is_lossless_against_a_four_bit_target(shape):
    """Greedy speculation on a 4-bit target equals plain greedy decoding of that target (HF generate: prefill,
    then one row per step)."""
    target, draft = tiny_model("llama", seed=1), tiny_model("llama", seed=1)
    with torch.no_grad():
        for module in target.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(four_bit(module.weight))
        for p in draft.parameters():
            p.add_(0.003 * torch.randn_like(p))
    format_weights(target, FOUR_BIT)
    assert int4_share(target) > 0.5
    assert assert_speculation_is_plain_greedy(target, LMDrafter(draft, 1000), FOUR_BIT, shape).tau > 1.2


def test_requantize_rounds_every_layer_to_int4():
    """A drafter's layers (requantize): 4-bit already or not, every layer runs int4, within rounding of the float
    layer; without requantize, weights that are not 4-bit stay int8."""
    model, reference = tiny_model("qwen2", seed=4), tiny_model("qwen2", seed=4)
    format_weights(model, WeightFormat("rows", exact=False, four_bit=True, requantize=True))
    inner = [getattr(m.product, "product", m.product) for m in model.modules() if isinstance(m, RowQuantLinear)]
    assert inner and all(isinstance(p, Int4Product) for p in inner) and int4_share(model) == 1.0
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits.float()
    assert (got - want).abs().max() < 0.2 * want.abs().max()  # 4-bit weights: close, not equal
    unrounded = tiny_model("qwen2", seed=4)
    format_weights(unrounded, WeightFormat("rows", exact=False, four_bit=True))
    assert int4_share(unrounded) == 0.0


def test_an_int4_target_gets_an_all_int4_drafter_and_draft_vocabulary():
    """format_drafter: a drafter beside an int4 target runs every layer int4, in groups of DRAFTER_INT4_GROUP inputs
    where they divide the row (the tiny model's 128-wide down_proj) and of 32 elsewhere, its draft-vocabulary head
    too, and that head's logits are the full head's at those ids, to the bit."""
    from eagle_fsd.loading import DRAFTER_INT4_GROUP, LoadOptions, format_drafter

    target, draft = tiny_model("qwen2", seed=5), tiny_model("qwen2", seed=6)
    with torch.no_grad():
        for module in target.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(four_bit(module.weight))
    format_weights(target, FOUR_BIT)
    drafter = LMDrafter(draft, 1000)
    fmt = format_drafter(drafter, FOUR_BIT, LoadOptions(prepack="off", draft_quant="auto"), target)
    assert fmt == WeightFormat("rows", four_bit=True, requantize=True, exact=False, int4_group=DRAFTER_INT4_GROUP)
    assert int4_share(draft) == 1.0
    groups = {name: own_product(m.product).group for name, m in draft.named_modules() if isinstance(m, RowQuantLinear)}
    assert DRAFTER_INT4_GROUP == 128 and draft.config.intermediate_size == 128
    assert groups == {name: 128 if name.endswith("down_proj") else 32 for name in groups}, groups
    hidden = torch.randn(3, draft.config.hidden_size, generator=torch.Generator().manual_seed(5))
    full = drafter.draft_head(hidden)
    ids = torch.tensor([7, 3, 999, 500, 42])
    drafter.set_draft_vocab(ids)
    assert isinstance(drafter.draft_head.quant.product, Int4Product)
    assert torch.equal(drafter.draft_head(hidden), full[:, ids])


@pytest.mark.skipif(len(ISAS) < 2, reason="needs a CPU with AVX-512 VNNI to compare the two builds")
def test_avx2_build_gives_the_avx512_builds_bits():
    g = torch.Generator().manual_seed(11)
    for rows, out_features, in_features in ((1, 48, 96), (5, 300, 128), (16, 64, 4096), (23, 1536, 256)):
        w = torch.randn(out_features, in_features, generator=g) * 0.05
        b = torch.randn(out_features, generator=g)
        x = torch.randn(rows, in_features, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
        x[:, 7] *= 50  # an outlier channel: the extreme codes +-127 in every row
        for group in (32, 128)[: 1 + (in_features % 128 == 0)]:
            packed = k4.pack_int4(*k4.quantize_int4(w, group))
            ys = [k4.int4_rows_linear(x, packed, out_features, b, isa=isa) for isa in ISAS]
            assert all(torch.equal(y, ys[0]) for y in ys[1:]), (rows, out_features, in_features, group)


@pytest.mark.parametrize("group", [32, 128])
def test_extreme_codes_do_not_saturate_the_avx2_pair_sums(group):
    # every code 15 and every activation +-127 (a row of +-127: scale 1): each int16 slot of the AVX2 build holds
    # 8 * 2 * 15 * 127 = 30480 per part of 32 inputs, and the product is 15 * 127 * 256 exactly
    q = torch.full((16, 256), 15, dtype=torch.uint8)
    s, m = torch.ones(16, 256 // group, dtype=torch.half), torch.zeros(16, 256 // group, dtype=torch.half)
    packed = k4.pack_int4(q, s, m)
    for sign in (1.0, -1.0):
        x = torch.full((1, 256), sign * 127)
        for isa in ISAS:
            y = k4.int4_rows_linear(x, packed, 16, isa=isa)
            assert torch.equal(y, torch.full((1, 16), sign * 15.0 * 127 * 256)), isa


def test_builds_follow_cpu_flags_and_torch_capability():
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni"}
    assert k4.runnable_isas(avx512, "AVX512") == ["avx512_vnni", "avx2"]
    assert k4.runnable_isas(avx512, "AVX2") == ["avx2"]  # ATEN_CPU_CAPABILITY=avx2: measure an AVX2 machine
    assert k4.runnable_isas(avx512, "DEFAULT") == []
    assert k4.runnable_isas({"avx2", "fma", "f16c", "avx512f"}, "AVX2") == ["avx2"]  # AVX-512 without VNNI
    assert k4.runnable_isas({"avx2", "fma"}, "AVX2") == []  # no fp16 conversion
    assert k4.runnable_isas({"sse4_2"}, "") == []


def test_unavailable_without_avx2(monkeypatch):
    k4.int4_rows_isa.cache_clear()
    monkeypatch.setattr(k4, "cpu_flags", lambda: {"sse4_2", "fma", "f16c"})
    try:
        assert not k4.int4_rows_available()
        with pytest.raises(RuntimeError, match="AVX2"):
            k4.int4_rows_linear(torch.zeros(1, 32), torch.zeros(1, 1, 320, dtype=torch.uint8), 16)
    finally:
        k4.int4_rows_isa.cache_clear()
