"""The target's linear layers int8 x int8 (eagle_fsd.target_quant): within the rounding bound of a float64
reference, each row independent of the others in its call (what makes verification equal plain decoding), the swap
of a whole model, lossless speculation against the quantized model, and when "auto" turns it on."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle_fsd.cache import TreeCache
from eagle_fsd.drafting import LMDrafter
from eagle_fsd.fused_decoder import fused_fits
from eagle_fsd.hf import causal_mask, decoder_forward, prefix_tree_mask
from eagle_fsd.loading import model_run, plan_for
from eagle_fsd.model import EaFsdModel, exactness
from eagle_fsd.kernels.int4_rows import cpu_flags
from eagle_fsd.plan import WeightFormat
from eagle_fsd.settings import add_fsd_args, add_model_args, parse_settings
from eagle_fsd import target_quant
from eagle_fsd.target_quant import (Int8Product, RowQuantLinear, activation_bits, cpu_activation_bits,
                                    row_int8_supported)
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tune import dtype as tune_dtype
from eagle_fsd.tune import resolve_target_quant
from eagle_fsd.weights import format_weights
from tiny import hf_greedy, tiny_model

pytestmark = pytest.mark.skipif(not row_int8_supported("cpu"), reason="this PyTorch has no FBGEMM int8 linear")
BITS = [bits for bits in (8, 7) if bits <= cpu_activation_bits()]  # 8 needs VNNI (32-bit sums of 8-bit products)
ROWS = WeightFormat("rows")  # an exact int8 x int8 target
ROWS_DRAFTER = WeightFormat("rows", exact=False)  # a drafter's int8 layers, each call rounded with one scale


def target_run(model, fmt=WeightFormat()):
    """How the loader's plan runs `model` as a target with weights in `fmt`."""
    return model_run(model, fmt, "auto", exact=True, decoder=True)


def is_target_quantized(model) -> bool:
    return any(isinstance(m, RowQuantLinear) for m in model.modules())


def random_linear(out_f, in_f, bias, g, dtype=torch.float32):
    linear = nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(out_f, generator=g))
    return linear.to(dtype)


def rounding_bound(x: torch.Tensor, w: torch.Tensor, levels: int, per_row: bool = True) -> torch.Tensor:
    """|y - x W^T| per element when W is rounded to s_o q (|error| <= s_o / 2) and each row of x to m_i (u - z) / r
    (|error| <= m_i / 2r): sum_j |W_oj| e_x + |x_ij| e_w + e_x e_w, plus fp32 rounding of the result. per_row False:
    the whole call rounded in steps of (hi - lo) / 2r' <= 2m / 2r' (r' = r + 1/2), m its largest |x|, so again
    |error| <= m / 2r."""
    x, w = x.double(), w.double()
    peak = x.abs().amax(1, keepdim=True) if per_row else x.abs().amax().expand(x.shape[0], 1)
    e_x = peak / (2 * levels)  # (rows, 1)
    e_w = w.abs().amax(1) / 254  # (out,)
    bound = e_x * w.abs().sum(1) + x.abs().sum(1, keepdim=True) * e_w + e_x * e_w * w.shape[1]
    return bound * (1 + 1e-5) + 1e-5 * (x.abs() @ w.abs().t())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_row_int8_within_rounding_bound_of_float64(bits, bias, rows):
    g = torch.Generator().manual_seed(rows * 10 + bits + bias)
    linear = random_linear(96, 160, bias, g)
    x = torch.randn(rows, 160, generator=g)
    x[:, 7] *= 40  # an outlier channel, as LLM activations have
    layer = RowQuantLinear.from_linear(linear, bits)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    want = F.linear(x.double(), linear.weight.double(), None if not bias else linear.bias.double())
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    error = (got.double() - want).abs()
    assert (error <= rounding_bound(x, linear.weight, 2 ** (bits - 1) - 1)).all()
    assert error.max() > 0  # it does round: not the float product under another name


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bias", [False, True])
def test_drafter_layers_round_each_call_with_one_scale(bits, bias):
    """A drafter's layers (WeightFormat("rows", exact=False)): the call rounded as one, within the bound its largest |x|
    gives, and so a row's result depends on the rows beside it (which a target's layer must never do)."""
    g = torch.Generator().manual_seed(bits + 2 * bias)
    linear = random_linear(96, 160, bias, g)
    layer = RowQuantLinear.from_linear(linear, bits, per_row=False)
    x = torch.randn(6, 160, generator=g) * torch.tensor([1.0, 1, 1, 1, 1, 30])[:, None]
    x[:, 7] *= 40
    want = F.linear(x.double(), linear.weight.double(), None if not bias else linear.bias.double())
    error = (layer(x).double() - want).abs()
    assert (error <= rounding_bound(x, linear.weight, 2 ** (bits - 1) - 1, per_row=False)).all()
    assert error.max() > 0
    assert not torch.equal(layer(x[:5]), layer(x)[:5])  # the big sixth row coarsened the others' rounding
    assert (layer(x[:5]).double() - want[:5]).abs().max() < error[:5].max()


def test_activation_bits_beyond_the_cpu_are_an_error(monkeypatch):
    """Without VNNI FBGEMM sums 8-bit products in 16 bits and saturates: 8 bits there is refused by name, None is
    the CPU's own, and only 7 or 8 exist."""
    weight = torch.randn(32, 64)
    monkeypatch.setattr(target_quant, "cpu_activation_bits", lambda: 7)  # an AVX2-only CPU
    with pytest.raises(ValueError, match=r"activation_bits=8: this CPU has no VNNI.*use 7"):
        Int8Product(weight, None, 8)
    with pytest.raises(ValueError, match=r"activation_bits=6: use 7 or 8"):
        Int8Product(weight, None, 6)
    assert Int8Product(weight, None).activation_bits == 7 == RowQuantLinear.from_weight(weight, None).activation_bits
    monkeypatch.setattr(target_quant, "cpu_activation_bits", lambda: 8)  # VNNI
    assert Int8Product(weight, None).activation_bits == 8 and Int8Product(weight, None, 7).activation_bits == 7


def test_quantized_drafter_rounds_per_call_and_attends_in_fp32():
    model = tiny_model("qwen2", seed=5)
    format_weights(model, ROWS_DRAFTER)
    products = {id(m.product): m.product for m in model.modules() if isinstance(m, RowQuantLinear)}
    assert products and not any(p.per_row for p in products.values())
    drafter = LMDrafter(model, model.config.vocab_size)
    drafter.set_draft_vocab(torch.arange(0, model.config.vocab_size, 3))  # its lm_head's rows: rounded the same way
    assert drafter.draft_head.quant.product.per_row is False
    target = tiny_model("qwen2", seed=5)
    format_weights(target, ROWS)
    assert all(m.product.per_row for m in target.modules() if isinstance(m, RowQuantLinear))
    plan = plan_for(target, drafter, TreeShape(8, 3, 2), (ROWS, ROWS_DRAFTER))  # how the engine runs the two
    assert plan.drafter.fp64_attention is False and plan.drafter.kv_dtype is None
    assert plan.target.fp64_attention is True


def test_each_row_is_independent_of_its_batch():
    """A row's output is bit for bit the same alone and among others: a tree's tokens get what plain decoding
    steps would give them."""
    g = torch.Generator().manual_seed(3)
    layer = RowQuantLinear.from_linear(random_linear(200, 128, True, g))
    x = torch.randn(17, 128, generator=g) * torch.logspace(-2, 2, 17)[:, None]  # rows of very different scales
    together = layer(x)
    for n in (1, 2, 4, 5, 8, 16):
        assert torch.equal(layer(x[:n]), together[:n])
    for i in range(17):
        assert torch.equal(layer(x[i:i + 1]), together[i:i + 1])
    assert torch.equal(layer(x.reshape(1, 17, 128)), together.reshape(1, 17, 200))  # any leading shape


def test_bf16_weight_and_activations():
    """bf16 weights are read as they are; bf16 activations come back bf16; the layer keeps the bf16 weight it shares,
    on which a run as loaded is F.linear."""
    g = torch.Generator().manual_seed(5)
    linear = random_linear(64, 96, True, g, torch.bfloat16)
    layer = RowQuantLinear.from_linear(linear)
    x = torch.randn(3, 96, generator=g)
    want = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    assert (layer(x).double() - want).abs().max() <= rounding_bound(x, linear.weight.float(), 127).max()
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert layer.weight is linear.weight and layer.bias is linear.bias and layer.weight.dtype == torch.bfloat16
    assert torch.equal(F.linear(x.bfloat16(), layer.weight, layer.bias), linear(x.bfloat16()))


def test_rows_format_swaps_every_linear_and_runs_fp32():
    model = tiny_model("qwen2", seed=2, tie_word_embeddings=True).to(torch.bfloat16)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert format_weights(model, ROWS) == linears and is_target_quantized(model)
    assert all(isinstance(m, RowQuantLinear) for m in model.modules() if isinstance(m, nn.Linear))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for m in model.modules() if not isinstance(m, RowQuantLinear)
               for p in m.parameters(recurse=False))
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16  # kept as loaded, shared, not run
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_an_exact_target_stores_its_cache_in_float64_and_attends_to_the_same_numbers():
    """Through transformers' layers (a GELU MLP: not the fused decoder's shape) an exact target attends in float64."""
    model = tiny_model("qwen2", seed=6, hidden_act="gelu")
    float_run = target_run(model)
    assert TreeCache.for_model(model, 8, float_run).layers[0].storage_dtype is None  # float target: keys as they come
    format_weights(model, ROWS)
    run = target_run(model, ROWS)
    assert not fused_fits(model) and not run.fused and run.fp64_attention
    ids = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(1))
    outputs = []
    for cache in (TreeCache(model.config.num_hidden_layers, 16), TreeCache.for_model(model, 16, run)):
        with torch.no_grad():
            prefill = decoder_forward(model, ids[:9], cache, causal_mask(0, 9, "cpu"), torch.arange(9), run)
            tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
            step = decoder_forward(model, ids[9:], cache, prefix_tree_mask(9, tree), torch.tensor([9, 10, 10]), run)
        outputs.append((prefill, step, cache.layers[0].keys.dtype))
    (prefill32, step32, dtype32), (prefill64, step64, dtype64) = outputs
    assert dtype32 == torch.float32 and dtype64 == torch.float64  # widened once, when stored
    assert torch.equal(prefill32, prefill64) and torch.equal(step32, step64)


def test_a_fused_exact_target_keeps_an_fp32_cache():
    """The fused decoder attends in fp32, each row alone (eagle_fsd.kernels.decoder_glue.attend): no wider cache."""
    model = tiny_model("qwen2", seed=6)
    format_weights(model, ROWS)
    run = target_run(model, ROWS)
    assert run.fused == fused_fits(model)
    want = None if fused_fits(model) else torch.float64
    assert TreeCache.for_model(model, 8, run).layers[0].storage_dtype == want


@pytest.mark.parametrize("shape", [(12, 3, 3), (8, 7, 1)])
def test_engine_is_lossless_against_the_quantized_target(shape):
    """Greedy speculation with an int8 target equals plain greedy decoding of that same int8 target (the engine's
    plain loop: prefill, then one row per step through the same layers; transformers' forward of it rounds its norms
    and attention otherwise, eagle_fsd.fused_decoder)."""
    target, draft = tiny_model("llama", seed=1), tiny_model("llama", seed=1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.003 * torch.randn_like(p))
    float_target = copy.deepcopy(target)  # the target as loaded
    format_weights(target, ROWS)
    ids = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(3))
    drafter = LMDrafter(draft, 1000)
    model = EaFsdModel(target, None, drafter, plan=plan_for(target, drafter, TreeShape(*shape), (ROWS, None)))
    out = model.generate(ids, max_new_tokens=30, eos_token_id=[], return_dict=True)
    plain = model.naive_generate(ids, max_new_tokens=30, eos_token_id=[])
    assert plain.shape == (1, 40) and torch.equal(out.sequences, plain)
    assert out.tau > 1.2
    float_greedy = hf_greedy(float_target, ids, 30)  # the float model decodes differently: the quantized one is
    # what was matched
    assert float_greedy.shape == plain.shape


def test_draft_vocabulary_of_a_quantized_head_scores_its_rows():
    """An EAGLE-style draft head scoring a draft vocabulary of the int8 target's lm_head gives exactly those
    columns of the full head's logits (the same int8 rows, each column independent)."""
    target = tiny_model("llama", seed=6)
    format_weights(target, ROWS)
    drafter = LMDrafter(target, 1000)  # owner = the quantized model itself
    hidden = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    full = drafter.draft_head(hidden)
    ids = torch.arange(3, 1000, 7)
    drafter.draft_head.set_draft_vocab(ids)
    assert isinstance(drafter.draft_head.quant, RowQuantLinear)
    assert torch.equal(drafter.draft_head(hidden), full[:, ids])


def described(model):
    """What resolve_target_quant decides on before a target loads: its config, dtype and device."""
    return model.config, model.dtype, model.device


def test_resolve_target_quant_rules(monkeypatch):
    target = tiny_model("llama", seed=0)
    assert resolve_target_quant("off", *described(target), True, False) == 0
    assert resolve_target_quant("int8", *described(target), False, True) == 8  # forced: any model, any dtype
    for spelling in ("on", "int2", True):
        with pytest.raises(ValueError, match=f"target_quant={spelling!r}: use 'auto', 'int4', 'int8' or 'off'"):
            resolve_target_quant(spelling, *described(target), True, False)
    calls = []

    def timing(int8_ms, int4_ms=20.0):
        def mlp_kernel_ms(hidden, intermediate, kinds, rows=(1, 4, 8), watch=None):
            calls.append(kinds)
            return {kind: {"int8-rows": int8_ms, "int4-rows": int4_ms}.get(kind, 10.0) for kind in kinds}
        return mlp_kernel_ms
    monkeypatch.setattr(tune_dtype, "int4_rows_available", lambda: True)
    tune_dtype.forget_races()  # kept timings and choices
    monkeypatch.setattr(tune_dtype, "mlp_kernel_ms", timing(4.0))  # int8 faster than every float kernel and int4
    assert resolve_target_quant("auto", *described(target), True, False) == 8
    assert {"int8-rows", "int4-rows"} <= set(calls[-1]) and len(calls[-1]) >= 3
    assert resolve_target_quant("auto", *described(target), False, False) == 0  # a hub id or directory: float weights
    assert resolve_target_quant("auto", *described(target), True, True) == 0  # a dtype named: that precision
    tune_dtype.forget_races()  # kept timings and choices
    monkeypatch.setattr(tune_dtype, "mlp_kernel_ms", timing(4.0, 2.0))  # int4 fastest
    assert resolve_target_quant("auto", *described(target), True, False) == 4
    tune_dtype.forget_races()  # kept timings and choices
    monkeypatch.setattr(tune_dtype, "mlp_kernel_ms", timing(12.0))  # both slower: the float kernels stay
    assert resolve_target_quant("auto", *described(target), True, False) == 0
    tune_dtype.forget_races()  # kept timings and choices
    monkeypatch.setattr(tune_dtype, "int4_rows_available", lambda: False)  # no VNNI / compiler: int4 not timed
    monkeypatch.setattr(tune_dtype, "mlp_kernel_ms", timing(4.0, 2.0))
    assert resolve_target_quant("auto", *described(target), True, False) == 8 and "int4-rows" not in calls[-1]
    with pytest.raises(ValueError, match="target_quant int4 needs a CPU with AVX-512 VNNI"):
        resolve_target_quant("int4", *described(target), True, False)
    tune_dtype.forget_races()  # kept timings and choices


def test_activation_bits_follow_vnni():
    assert activation_bits({"avx2", "avx512_vnni"}) == 8 and activation_bits({"amx_int8"}) == 8
    assert activation_bits({"avx2", "fma"}) == 7


def test_settings_and_exactness_name_the_quantized_model():
    import argparse
    p = argparse.ArgumentParser()
    add_model_args(p)
    add_fsd_args(p)
    assert parse_settings(p, p.parse_args(["--target-quant", "off"])).model.target_quant == "off"
    assert parse_settings(p, p.parse_args([])).model.target_quant == "auto"
    assert parse_settings(p, p.parse_args(["--target-quant", "int4"])).model.target_quant == "int4"
    with pytest.raises(SystemExit):
        p.parse_args(["--target-quant", "int2"])
    text = exactness(torch.float32, target_quantized=True)
    assert "quantized target" in text and "Q4_K / Q6_K blocks" in text and "--target-quant off" in text


def test_smollm2_with_its_head_on_an_int8_target():
    """Real SmolLM2 and its shipped EAGLE head: target_quant "int8" swaps every target linear, the head drafts
    from the fp32 features, and greedy speculation equals plain greedy decoding of the int8 model."""
    model = EaFsdModel.from_pretrained("smollm2-135m-instruct", target_quant="int8", total_token=8, depth=3, top_k=2,
                                       draft_vocab=0)
    assert is_target_quantized(model.base_model) and model.base_model.dtype == torch.float32
    assert all(isinstance(m, RowQuantLinear) for m in model.base_model.modules() if isinstance(m, nn.Linear))
    assert model.plan.target.weights.quantized_rows and model.plan.target.fp64_attention
    ids = model.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=40, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, model.naive_generate(ids, max_new_tokens=40, eos_token_id=[]))
    assert out.tau > 1.5


def test_siblings_share_one_product_with_unchanged_results():
    """q/k/v (with Qwen2's biases) and gate/up become columns of one product each, called once per input; each
    layer's output is bit for bit its own RowQuantLinear's, and another input (or one changed in place) is
    recomputed, not served from the last call."""
    from eagle_fsd.target_quant import Rounding, SharedInputProduct, share_product
    model = tiny_model("qwen2", seed=7)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    alone = {name: RowQuantLinear.from_linear(getattr(attention, name)) for name in ("q_proj", "k_proj", "v_proj")}
    alone |= {name: RowQuantLinear.from_linear(getattr(mlp, name)) for name in ("gate_proj", "up_proj")}
    assert share_product(attention, ("q_proj", "k_proj", "v_proj"), Rounding()) == 3
    assert share_product(mlp, ("gate_proj", "up_proj"), Rounding()) == 2
    assert share_product(mlp, ("gate_proj", "up_proj"), Rounding()) == 0  # already shared
    assert isinstance(attention.k_proj.product, SharedInputProduct) and attention.k_proj.product is attention.q_proj.product
    g = torch.Generator().manual_seed(2)
    for rows in (1, 6):
        x = torch.randn(1, rows, 64, generator=g)
        for parent in (attention, mlp):
            for name, layer in alone.items():
                if hasattr(parent, name) and isinstance(getattr(parent, name), RowQuantLinear):
                    assert torch.equal(getattr(parent, name)(x), layer(x)), name
    x = torch.randn(2, 64, generator=g)
    attention.q_proj(x)
    x.mul_(3)  # changed in place: the next sibling must not reuse the product of the old values
    assert torch.equal(attention.k_proj(x), alone["k_proj"](x))
    assert torch.equal(attention.v_proj(x.clone()), alone["v_proj"](x))


def test_torch_capability_caps_the_activation_bits(monkeypatch):
    # ATEN_CPU_CAPABILITY=avx2 on a VNNI CPU stands for an AVX2-only one: its 7-bit rows (and int8_rows' AVX2 build)
    try:
        for capability, bits in (("AVX2", 7), ("DEFAULT", 7), ("AVX512", activation_bits(cpu_flags()))):
            monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
            cpu_activation_bits.cache_clear()
            assert cpu_activation_bits() == bits, capability
    finally:
        cpu_activation_bits.cache_clear()
