"""Prepacked oneDNN linear weights: the same product as F.linear, swapped in place, lossless in the loop."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle_fsd.drafting import LMDrafter
from eagle_fsd.loading import plan_for
from eagle_fsd.model import EaFsdModel
from eagle_fsd.prepack import PackedLinear, prepack_supported
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tune import dtype as tune_dtype
from eagle_fsd.tune import resolve_prepack
from eagle_fsd.weights import PREPACKED, format_weights
from tiny import hf_greedy, tiny_model

BF16 = prepack_supported(torch.bfloat16, "cpu")
FP32 = prepack_supported(torch.float32, "cpu")
needs_bf16 = pytest.mark.skipif(not BF16, reason="oneDNN has no bf16 support on this CPU (no AVX-512 BF16 / AMX)")


def is_prepacked(model) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(5,), (1, 7), (2, 3)])
def test_packed_linear_is_f_linear(dtype, bias, lead):
    g = torch.Generator().manual_seed(sum(lead) + bias)
    linear = nn.Linear(48, 80, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 48, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(80, generator=g))
    x = torch.randn(*lead, 48, generator=g).to(dtype)
    packed = PackedLinear.from_linear(linear)
    assert packed.weight is linear.weight and packed.bias is linear.bias
    want = F.linear(x.double(), linear.weight.double(), None if not bias else linear.bias.double())
    got = packed(x)
    assert got.shape == (*lead, 80) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_prepack_swaps_every_linear_and_keeps_the_weights():
    model = tiny_model("qwen2", seed=2, tie_word_embeddings=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert format_weights(model, PREPACKED) == linears and is_prepacked(model)
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == linears
    assert not any(type(m) is nn.Linear for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied


def test_prepacked_logits_and_the_shared_float_weights(monkeypatch):
    plain = tiny_model("llama", seed=4)
    packed = tiny_model("llama", seed=4)
    format_weights(packed, PREPACKED)
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = plain(ids).logits
        got = packed(ids).logits
        assert torch.allclose(got, want, atol=1e-4)
        with monkeypatch.context() as patch:  # each packed layer as F.linear on the weight it shares
            patch.setattr(PackedLinear, "forward", lambda layer, x: F.linear(x, layer.weight, layer.bias))
            assert torch.equal(packed(ids).logits, want)  # the plain kernel again, bit for bit
        assert torch.equal(packed(ids).logits, got)  # the packed kernel again


@pytest.mark.parametrize("shape", [(12, 3, 3), (8, 7, 1)])
def test_prepacked_engine_is_lossless(shape):
    """Greedy with prepacked target and LM drafter (fp32) equals the same target's greedy through HF generate."""
    target, draft = tiny_model("llama", seed=1), tiny_model("llama", seed=1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.003 * torch.randn_like(p))
    ids = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(3))
    format_weights(target, PREPACKED), format_weights(draft, PREPACKED)
    drafter = LMDrafter(draft, 1000)
    drafter.draft_head.set_draft_vocab(torch.arange(0, 1000, 2))  # the packed reduced-vocabulary lm_head too
    assert drafter.draft_head.packed is not None
    plan = plan_for(target, drafter, TreeShape(*shape), (PREPACKED, PREPACKED))
    model = EaFsdModel(target, None, drafter, plan=plan)
    out = model.generate(ids, max_new_tokens=30, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 30))
    assert out.tau > 1.2


def test_resolve_prepack_rules(monkeypatch):
    fp32 = tiny_model("llama", seed=0)
    assert resolve_prepack(False, fp32) is False and resolve_prepack("off", fp32) is False
    assert resolve_prepack(True, fp32) is FP32 and resolve_prepack("on", fp32) is FP32
    for winner, packs in (("fp32-packed", True), ("fp32", False)):  # auto: what the timing of both kinds says
        monkeypatch.setattr(tune_dtype, "fastest_kind", lambda hidden, intermediate, kinds, w=winner: w)
        assert resolve_prepack("auto", fp32) is (packs and FP32)
    fp16 = tiny_model("llama", seed=0).to(torch.float16)
    assert resolve_prepack("auto", fp16) is False
    for forced in (True, "on"):
        with pytest.raises(ValueError, match="prepack on needs a CPU model in fp32, or in bf16 with oneDNN bf16"):
            resolve_prepack(forced, fp16)
    with pytest.raises(ValueError, match="prepack='yes'"):
        resolve_prepack("yes", fp32)
    if BF16:
        assert resolve_prepack("on", fp32.to(torch.bfloat16)) is True


@needs_bf16
def test_from_pretrained_prepacks_target_and_drafter():
    """Real SmolLM2 in bf16 with its shipped head: prepack=True swaps target and head, prepack=False leaves both."""
    load = dict(dtype=torch.bfloat16, total_token=8, depth=3, top_k=2)
    model = EaFsdModel.from_pretrained("smollm2-135m-instruct", prepack=True, **load)
    plain = EaFsdModel.from_pretrained("smollm2-135m-instruct", prepack=False, **load)
    assert is_prepacked(model.base_model) and is_prepacked(model.drafter.module)
    assert not is_prepacked(plain.base_model) and not is_prepacked(plain.drafter.module)
    assert model.plan.target.weights == PREPACKED and model.plan.drafter.weights == PREPACKED
    assert plain.plan.target.weights.kind == "float" and plain.plan.drafter.weights.kind == "float"
    ids = model.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = model.base_model(ids).logits.float(), plain.base_model(ids).logits.float()
    assert torch.allclose(a, b, atol=3e-2 * b.abs().max().item())
    out = model.generate(ids, max_new_tokens=12, eos_token_id=[], return_dict=True)
    assert out.new_tokens == 12 and out.tau > 1.0
