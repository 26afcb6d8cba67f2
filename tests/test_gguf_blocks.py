"""A quantized target on a GGUF file's own Q4_K / Q6_K blocks (eagle_fsd.gguf_blocks): each layer found by name and
checked against the loaded weight, siblings of one block format stacked into one product, products surviving the
store, and greedy speculation on such a target equal to its plain greedy decoding. A tiny Qwen2 whose weights are
written as a GGUF of random valid blocks. Needs the kquant_rows kernel (AVX-512 VNNI or AVX2 and a C++ compiler)."""
import pytest
import torch
from torch import nn

from eagle_fsd.drafting import LMDrafter
from eagle_fsd import gguf_blocks
from eagle_fsd.gguf_blocks import GgufBlocks, KQuantProduct, gguf_tensor_name
from eagle_fsd.kernels import kquant_rows as kq
from eagle_fsd.loading import model_run
from eagle_fsd.plan import WeightFormat
from eagle_fsd.product_store import ProductStore, settings_of
from eagle_fsd.target_quant import Int8Product, RowQuantLinear, gguf_share, int4_share, own_product
from eagle_fsd.weights import format_weights
from tiny import assert_speculation_is_plain_greedy, tiny_model

pytestmark = pytest.mark.skipif(not kq.kquant_rows_available(), reason="needs AVX-512 VNNI or AVX2 and a C++ compiler")
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
Q6_K_LAYERS = ("self_attn.v_proj", "mlp.down_proj")  # Q4_K_M's 6-bit tensors (in some layers; here in layer 0)


def gguf_model(tmp_path, seed=0, skip=()):
    """(tiny Qwen2 whose linear weights are the blocks of a GGUF written to tmp_path, that GGUF's path). Layer 0's
    v_proj and down_proj and the lm_head are Q6_K, the rest Q4_K; the module names in `skip` are left out of the
    file (their layers keep their float weights)."""
    from gguf import GGUFWriter

    model = tiny_model("qwen2", seed=seed, vocab=1008, **SIZES)
    generator = torch.Generator().manual_seed(seed)
    path = tmp_path / f"tiny-{seed}.gguf"
    writer = GGUFWriter(str(path), arch="qwen2")
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or name in skip:
                continue
            six = name == "lm_head" or (name.startswith("model.layers.0.") and name.endswith(Q6_K_LAYERS))
            kind = "q6_k" if six else "q4_k"
            raw = kq.random_blocks(kind, *module.weight.shape, generator)
            module.weight.copy_(kq.dequantize(kind, raw).float())
            writer.add_tensor(gguf_tensor_name(name), raw.numpy(), raw_dtype=kq.GGML_TYPES[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, path


def test_tensor_names_follow_llama_cpp():
    assert gguf_tensor_name("model.layers.12.self_attn.q_proj") == "blk.12.attn_q.weight"
    assert gguf_tensor_name("model.layers.0.self_attn.o_proj") == "blk.0.attn_output.weight"
    assert gguf_tensor_name("model.layers.3.mlp.down_proj") == "blk.3.ffn_down.weight"
    assert gguf_tensor_name("lm_head") == "output.weight"
    assert gguf_tensor_name("model.layers.0.self_attn.rotary_emb") is None and gguf_tensor_name("fc") is None


def test_layers_run_on_the_files_blocks_siblings_stacked_by_format(tmp_path):
    model, path = gguf_model(tmp_path, skip=("model.layers.1.mlp.up_proj",))
    fmt = WeightFormat("rows", four_bit=True, gguf=str(path))
    format_weights(model, fmt)
    products = {name: own_product(m.product) for name, m in model.named_modules() if isinstance(m, RowQuantLinear)}
    kinds = {name: getattr(p, "kind", type(p).__name__) for name, p in products.items()}
    assert kinds["lm_head"] == "q6_k" and kinds["model.layers.0.self_attn.v_proj"] == "q6_k"
    assert kinds["model.layers.0.self_attn.q_proj"] == "q4_k" and kinds["model.layers.1.self_attn.v_proj"] == "q4_k"
    assert kinds["model.layers.0.mlp.down_proj"] == "q6_k" and kinds["model.layers.1.mlp.down_proj"] == "q4_k"
    assert kinds["model.layers.1.mlp.up_proj"] == "Int8Product"  # not in the file: re-rounded as before
    layer0 = model.model.layers[0].self_attn
    assert layer0.q_proj.product is layer0.k_proj.product and layer0.v_proj.product is not layer0.q_proj.product
    assert products["model.layers.0.self_attn.q_proj"].out_features == 256 + 128  # q and k stacked
    assert 0.8 < gguf_share(model) < 1 and 0.5 < int4_share(model) < gguf_share(model)
    run = model_run(model, fmt, "auto", exact=True, decoder=True)
    assert run.label().startswith("GGUF Q4_K / Q6_K blocks x int8") and run.key()["gguf_share"] == \
        round(gguf_share(model), 2)


def test_each_layer_computes_its_blocks_exact_values(tmp_path):
    """A layer's output is the float64 reference of its GGUF values (rounded rows), not of some other rounding.
    Mutation: the siblings' blocks stacked in reverse (`reversed(members)` in share_product) fails it."""
    model, path = gguf_model(tmp_path, seed=1)
    reference = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    format_weights(model, WeightFormat("rows", four_bit=True, gguf=str(path)))
    blocks = GgufBlocks(path)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.up_proj",
                 "lm_head"):  # the columns of a stacked product, a Q6_K one, and single ones
        layer = model.get_submodule(name)
        kind, raw = blocks.kind(name), blocks.raw(name, reference[name])
        want = kq.kquant_rows_reference(x, kind, raw, None if layer.bias is None else layer.bias.detach())
        assert (layer(x).double() - want).abs().max() <= 1e-5 * want.abs().max(), name


def test_a_gguf_of_another_model_is_refused_by_name(tmp_path):
    model, path = gguf_model(tmp_path, seed=3)
    other = tiny_model("qwen2", seed=4, vocab=1008, **SIZES)
    with pytest.raises(ValueError, match=r"output\.weight does not hold lm_head's weight"):
        format_weights(other, WeightFormat("rows", four_bit=True, gguf=str(path)))
    wide = tiny_model("qwen2", seed=3, vocab=1008, **{**SIZES, "intermediate_size": 768})
    with torch.no_grad():  # the file's values wherever the shapes agree
        for (_, mine), (_, theirs) in zip(wide.named_parameters(), model.named_parameters()):
            if mine.shape == theirs.shape:
                mine.copy_(theirs)
    with pytest.raises(ValueError, match="ffn_gate.weight is"):
        format_weights(wide, WeightFormat("rows", four_bit=True, gguf=str(path)))
    with pytest.raises(FileNotFoundError, match="eagle-fsd models gguf"):
        GgufBlocks(tmp_path / "missing.gguf")


def test_products_survive_the_store_and_key_it(tmp_path):
    model, path = gguf_model(tmp_path, seed=5)
    fmt = WeightFormat("rows", four_bit=True, gguf=str(path))
    store = ProductStore(tmp_path / "products.safetensors")
    format_weights(model, fmt, store)
    store.save()
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(6))
    again, _ = gguf_model(tmp_path, seed=5)
    kept = ProductStore(tmp_path / "products.safetensors")
    format_weights(again, fmt, kept)
    assert kept.served > 0 and not kept.built
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "lm_head"):
        product = own_product(again.get_submodule(name).product)
        assert isinstance(product, KQuantProduct)
        assert torch.equal(again.get_submodule(name)(x), model.get_submodule(name)(x)), name
    assert settings_of(fmt)["gguf"][0] == str(path.resolve())
    assert settings_of(WeightFormat("rows"))["gguf"] is None


@pytest.mark.parametrize("shape", [(12, 3, 3), (8, 7, 1)])
def test_engine_is_lossless_on_a_gguf_block_target(tmp_path, shape):
    """Greedy speculation on the GGUF-block target equals plain greedy decoding of that target (HF generate: prefill,
    then one row per step), with its few-row forwards one C++ call (every product is an own kernel)."""
    target, path = gguf_model(tmp_path, seed=7)
    draft = tiny_model("qwen2", seed=7, vocab=1008, **SIZES)
    with torch.no_grad():
        draft.load_state_dict(target.state_dict())
        for p in draft.parameters():
            p.add_(0.003 * torch.randn_like(p))
    fmt = WeightFormat("rows", four_bit=True, gguf=str(path))
    format_weights(target, fmt)
    assert gguf_share(target) == 1.0
    assert assert_speculation_is_plain_greedy(target, LMDrafter(draft, 1008), fmt, shape).tau > 1.2


def test_the_blocks_are_used_where_their_build_measured_faster(monkeypatch):
    """The loader takes the blocks on the AVX-512 VNNI build only: the AVX2 build measured slower at 3-8 rows."""
    for isa, pays in (("avx512_vnni", True), ("avx2", False), (None, False)):
        monkeypatch.setattr(gguf_blocks, "kquant_rows_isa", lambda isa=isa: isa)
        assert gguf_blocks.blocks_pay() is pays, isa


def test_the_int8_fallback_stays_where_the_file_has_no_blocks(tmp_path):
    model, path = gguf_model(tmp_path, seed=8, skip=("lm_head",))
    format_weights(model, WeightFormat("rows", four_bit=True, gguf=str(path)))
    assert isinstance(own_product(model.lm_head.product), Int8Product)
    assert 0.5 < gguf_share(model) < 1
