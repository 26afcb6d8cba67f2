"""int4 / int8 drafting weights: the kernel computes x deq(W)^T + b, the rounding stays within its grid, swapped in
place, and decoding with a quantized drafter is still exactly the target's greedy output."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle_fsd.drafting import EagleDrafter, LMDrafter
from eagle_fsd.loading import plan_for
from eagle_fsd.model import EaFsdModel
from eagle_fsd.plan import WeightFormat
from eagle_fsd.prepack import PackedLinear, packed_linear, prepack_supported
from eagle_fsd.quant import INT4_GROUP, MAX_QUANT_ROWS, QuantLinear, dequantize, int4_fits, quant_supported
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tune import dtype as tune_dtype
from eagle_fsd.tune import resolve_draft_quant
from eagle_fsd.weights import PREPACKED, format_weights
from tiny import hf_greedy, tiny_model

needs = {bits: pytest.mark.skipif(not quant_supported(bits), reason=f"this PyTorch has no CPU int{bits} kernel")
         for bits in (4, 8)}
BITS = [pytest.param(4, marks=needs[4]), pytest.param(8, marks=needs[8])]
DTYPES = [torch.float32, torch.bfloat16]


def quant_bits(model) -> set[int]:
    """The bits of `model`'s QuantLinear layers (empty: none)."""
    return {m.bits for m in model.modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(3,), (1, MAX_QUANT_ROWS), (2, 2)])
def test_quant_linear_is_linear_of_the_dequantized_weight(bits, dtype, lead):
    g = torch.Generator().manual_seed(bits + len(lead))
    linear = nn.Linear(96, 48, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 96, generator=g) * 0.05)
        linear.bias.copy_(torch.randn(48, generator=g))
    layer = QuantLinear.from_linear(linear, bits)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    x = torch.randn(*lead, 96, generator=g).to(dtype)
    deq = dequantize(layer).double()
    want = F.linear(x.double(), deq, linear.bias.double())
    got = layer(x)
    assert got.shape == (*lead, 48) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.skipif(
    not prepack_supported(torch.bfloat16, "cpu"), reason="oneDNN has no bf16 support on this CPU"))])
def test_many_rows_use_the_original_weight(bits, packed):
    """Past MAX_QUANT_ROWS rows (a prefill) the layer is the original linear, prepacked or plain."""
    g = torch.Generator().manual_seed(11)
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    source = PackedLinear.from_linear(linear) if packed else linear
    layer = QuantLinear.from_linear(source, bits)
    assert (layer.packed is not None) == packed
    x = torch.randn(2, MAX_QUANT_ROWS, 64, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x), source(x))
        assert not torch.equal(layer(x[0]), source(x[0]))  # few rows: the rounded weight
        # ... while the layer keeps the original (shared weight, and its packed copy) bit for bit
        assert layer.weight is source.weight and layer.bias is source.bias
        bias = layer.bias.detach()
        original = packed_linear(x[0], layer.packed, bias) if packed else F.linear(x[0], layer.weight, bias)
        assert torch.equal(original, source(x[0]))


@pytest.mark.parametrize("bits", BITS)
def test_rounding_stays_on_its_grid(bits):
    """|w - deq(w)| <= half a step: s / 2 with s = (max - min) / 15 per group (int4), max|w| / 127 per row (int8)."""
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(7))
    layer = QuantLinear.from_weight(w, None, bits)
    err = (w - dequantize(layer)).abs()
    if bits == 4:
        groups = w.reshape(32, -1, INT4_GROUP)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(INT4_GROUP, dim=1)
    else:
        step = (w.abs().amax(1, keepdim=True) / 127).expand_as(w)
    assert (err <= step / 2 + 1e-6).all()
    assert err.max() > 0  # it did round


@pytest.mark.parametrize("bits", BITS)
def test_int_formats_swap_in_place_and_keep_the_weights(bits):
    model = tiny_model("qwen2", vocab=1000, seed=2, tie_word_embeddings=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    fits = [m for m in linears if bits == 8 or int4_fits(m.out_features, m.in_features)]
    assert format_weights(model, WeightFormat(f"int{bits}")) == len(fits) and quant_bits(model) == {bits}
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == len(fits)
    if bits == 4:  # 1000 output rows are not a multiple of 16: the lm_head stays a plain linear
        assert type(model.lm_head) is nn.Linear
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied


@pytest.mark.parametrize("bits", BITS)
def test_quantized_layers_keep_the_plain_weights(bits, monkeypatch):
    plain = tiny_model("llama", vocab=1024, seed=4)
    quantized = tiny_model("llama", vocab=1024, seed=4)
    format_weights(quantized, WeightFormat(f"int{bits}"))
    ids = torch.randint(0, 1024, (1, MAX_QUANT_ROWS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = plain(ids).logits
        assert not torch.equal(quantized(ids).logits, want)
        with monkeypatch.context() as patch:  # each quantized layer as F.linear on the weight it shares
            patch.setattr(QuantLinear, "forward", lambda layer, x: F.linear(x, layer.weight, layer.bias))
            assert torch.equal(quantized(ids).logits, want)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(12, 3, 3), (8, 7, 1)])
def test_quantized_drafter_is_lossless(bits, shape):
    """Greedy with an int4 / int8 LM drafter (fp32 target, reduced draft vocabulary scored by a quantized slice of
    the drafter's lm_head; its prefill runs the original weights, its tree levels the rounded ones) equals the
    target's own greedy output through HF generate."""
    target, draft = tiny_model("llama", vocab=1024, seed=1), tiny_model("llama", vocab=1024, seed=1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.003 * torch.randn_like(p))
    fmt = WeightFormat(f"int{bits}")
    format_weights(draft, fmt)
    drafter = LMDrafter(draft, 1024)
    ids_kept = torch.arange(0, 1024, 2)
    drafter.draft_head.set_draft_vocab(ids_kept)
    assert drafter.draft_head.quant is not None and drafter.draft_head.quant.bits == bits
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # the slice scores the kept ids as the quantized full head would
        full = F.linear(h.double(), dequantize(draft.lm_head).double())[:, ids_kept]
        assert torch.allclose(drafter.draft_head(h).double(), full, atol=1e-4 * full.abs().max().item())
        # many rows (a prefill): the slice runs the original weights' rows, as the full head runs its original weight
        many = torch.randn(MAX_QUANT_ROWS + 2, 64, generator=torch.Generator().manual_seed(6))
        assert torch.equal(drafter.draft_head.weight, draft.lm_head.weight[ids_kept])
        assert torch.equal(drafter.draft_head(many), F.linear(many, draft.lm_head.weight[ids_kept]))
        assert torch.equal(draft.lm_head(many), F.linear(many, draft.lm_head.weight))
    ids = torch.randint(0, 1024, (1, 10), generator=torch.Generator().manual_seed(3))
    model = EaFsdModel(target, None, drafter, plan=plan_for(target, drafter, TreeShape(*shape), (None, fmt)))
    out = model.generate(ids, max_new_tokens=30, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 30))
    assert out.tau > 1.2  # the noisy, rounded drafter still drafts the target's tokens


def test_resolve_draft_quant_rules(monkeypatch):
    lm = LMDrafter(tiny_model("llama", vocab=1024, seed=1), 1024)
    with pytest.raises(ValueError, match="draft_quant='int3'"):
        resolve_draft_quant("int3", lm)
    assert resolve_draft_quant("off", lm) == 0 and resolve_draft_quant("auto", None) == 0
    eagle = EagleDrafter.__new__(EagleDrafter)
    eagle.head = nn.Linear(4, 4)
    assert resolve_draft_quant("auto", eagle) == 0  # EAGLE heads stay as loaded
    monkeypatch.setattr(tune_dtype, "int4_measures_faster", lambda *a: True)
    assert resolve_draft_quant("auto", lm) == (4 if quant_supported(4) else 0)
    monkeypatch.setattr(tune_dtype, "int4_measures_faster", lambda *a: False)
    assert resolve_draft_quant("auto", lm) == 0
    monkeypatch.setattr(tune_dtype, "quant_supported", lambda bits, device="cpu": False)
    assert resolve_draft_quant("auto", lm) == 0
    with pytest.raises(ValueError, match="draft_quant int8 needs a drafter on the CPU"):
        resolve_draft_quant("int8", lm)


@pytest.mark.skipif(not (quant_supported(4) and prepack_supported(torch.bfloat16, "cpu")),
                    reason="needs the int4 kernel and oneDNN bf16")
def test_int4_replaces_a_prepacked_drafter():
    draft = tiny_model("llama", vocab=1024, seed=1).to(torch.bfloat16)
    format_weights(draft, PREPACKED)
    assert all(type(m) is PackedLinear for m in draft.modules() if isinstance(m, nn.Linear))
    assert tune_dtype.kernel_kind(draft, prepacked=True) == "bf16-packed"
    format_weights(draft, WeightFormat("int4"))
    assert quant_bits(draft) == {4} and isinstance(draft.lm_head, QuantLinear)
    assert draft.lm_head.packed is not None  # many rows keep the packed kernel


@pytest.mark.parametrize("current, int4, int4_ms, chosen", [
    ("bf16", "int4", 1.0, True), ("bf16", "int4", 3.0, False),
    ("fp32-packed", "int4-fp32", 1.0, True), ("fp32", "int4-fp32", 3.0, False),
])
def test_int4_is_chosen_when_it_times_faster_with_the_drafters_activations(monkeypatch, current, int4, int4_ms,
                                                                          chosen):
    """draft_quant "auto": int4 against the drafter's own kernel, fed the activations it will get (bf16 or fp32),
    over a draft level's few rows; chosen exactly when it times faster."""
    timed = []

    def fake_ms(hidden, intermediate, kinds, rows, watch=None):
        timed.append((kinds, rows))
        return {current: 2.0, int4: int4_ms}

    monkeypatch.setattr(tune_dtype, "mlp_kernel_ms", fake_ms)
    assert tune_dtype.int4_measures_faster.__wrapped__(256, 1024, current) is chosen
    assert timed == [((current, int4), (1, 2, 4))]
