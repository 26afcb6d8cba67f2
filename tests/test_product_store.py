"""Quantized products kept on disk (eagle_fsd.product_store): a product read back is bit for bit the one built, a
second load builds nothing, and the file is keyed by the weights and the settings."""
import os
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle_fsd.kernels.int4_rows import int4_rows_available
from eagle_fsd.kernels.int8_rows import int8_rows_available
from eagle_fsd.plan import WeightFormat
from eagle_fsd.product_store import ProductStore, format_cached, products_path
from eagle_fsd import target_quant
from eagle_fsd.target_quant import Int4Product, Int8Product, RowQuantLinear, own_product, product_from_state
from eagle_fsd.weights import format_weights
from test_int4_rows import four_bit
from tiny import tiny_model

SETTINGS = {  # (exact, four_bit, requantize): a target's products, a drafter's int8 (FBGEMM, one scale a call),
    "target": WeightFormat("rows", exact=True, four_bit=True, requantize=False),  # a drafter's all-int4
    "drafter-int8": WeightFormat("rows", exact=False, four_bit=False, requantize=False),
    "drafter-int4": WeightFormat("rows", exact=False, four_bit=True, requantize=True),
}


def saved_model(folder, seed=3):
    """A tiny Qwen2 (biases on q/k/v) whose MLP weights are 4-bit already, saved to and loaded from `folder`."""
    model = tiny_model("qwen2", seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for linear in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.self_attn.v_proj):
                linear.weight.copy_(four_bit(linear.weight))
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eagle_fsd").eval()


def products(model) -> dict[str, object]:
    return {name: own_product(m.product) for name, m in model.named_modules() if isinstance(m, RowQuantLinear)}


def logits(model, seed=0):
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def test_each_product_survives_its_state():
    """state() -> from_state() gives the same product, bias included, for every kind on fresh random inputs."""
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    kinds = [Int8Product(weight, bias, per_row=False), Int8Product(weight, None, per_row=False)]
    for bits in (7, 8):
        if int8_rows_available(bits):
            kinds += [Int8Product(weight, b, bits, rows_kernel=True) for b in (bias, None)]
    if int4_rows_available():
        kinds += [Int4Product(four_bit(weight), bias), Int4Product(four_bit(weight), None)]
    for product in kinds:
        again = product_from_state(product.state())
        assert type(again) is type(product)
        for rows in (1, 5):
            x = torch.randn(rows, 64, generator=g)
            assert torch.equal(again(x), product(x)), (type(product).__name__, product.bias is None)


@pytest.mark.parametrize("role", list(SETTINGS))
def test_a_second_load_reads_every_product_and_decodes_the_same(tmp_path, monkeypatch, role):
    """...without rounding a weight or scanning one for 4-bit groups."""
    fmt = SETTINGS[role]
    first = saved_model(tmp_path / "model")
    store = ProductStore(tmp_path / "products.safetensors")
    format_weights(first, fmt, store)
    built = len(store.built)
    assert built and store.served == 0
    store.save()

    second = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="eagle_fsd").eval()
    store = ProductStore(tmp_path / "products.safetensors")
    monkeypatch.setattr(target_quant, "fits_int4", lambda weight: pytest.fail("a weight scanned again"))
    format_weights(second, fmt, store)
    assert store.served == built and not store.built  # nothing rounded again
    assert torch.equal(logits(second), logits(first))
    before, after = products(first), products(second)
    assert before.keys() == after.keys()
    for name in before:
        assert type(after[name]) is type(before[name]), name
        for field, tensor in before[name].state().items():
            assert torch.equal(after[name].state()[field], tensor), (name, field)


def test_the_loader_keeps_products_in_the_cache(tmp_path, monkeypatch):
    """format_cached writes the file once (a second load leaves it untouched) and decodes the same."""
    monkeypatch.setenv("EAGLE_FSD_CACHE", str(tmp_path / "cache"))
    fmt = SETTINGS["target"]
    first = saved_model(tmp_path / "model")
    path = products_path(first, fmt)
    assert path.parent == tmp_path / "cache" / "products"
    format_cached(first, fmt)
    written = path.stat().st_mtime_ns
    second = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="eagle_fsd").eval()
    format_cached(second, fmt)
    assert path.stat().st_mtime_ns == written
    assert torch.equal(logits(second), logits(first))


def test_the_file_is_keyed_by_weights_dtype_and_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_FSD_CACHE", str(tmp_path / "cache"))
    model = saved_model(tmp_path / "model")
    path = products_path(model, SETTINGS["target"])
    assert products_path(model, SETTINGS["target"]) == path
    assert products_path(model, SETTINGS["drafter-int4"]) != path
    assert products_path(model, replace(SETTINGS["target"], activation_bits=7)) != \
        products_path(model, replace(SETTINGS["target"], activation_bits=8))
    assert products_path(model.to(torch.bfloat16), SETTINGS["target"]) != path
    model.float()
    weights = tmp_path / "model" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))  # the weights rewritten
    assert products_path(model, SETTINGS["target"]) != path
    assert products_path(tiny_model("qwen2"), SETTINGS["target"]) is None  # no folder: nothing kept


def test_a_mismatched_or_damaged_store_is_rebuilt(tmp_path):
    """A saved product of another shape is not served; an unreadable file counts as empty and is replaced."""
    weight = torch.randn(32, 64)
    path = tmp_path / "products.safetensors"
    store = ProductStore(path)
    store.product("layer", (32, 64), lambda: Int8Product(weight, None, per_row=False))
    store.save()
    store = ProductStore(path)
    rebuilt = store.product("layer", (16, 64), lambda: Int8Product(weight[:16], None, per_row=False))
    assert store.served == 0 and rebuilt.out_features == 16
    path.write_bytes(b"not a safetensors file")
    store = ProductStore(path)
    assert not store.saved
    store.product("layer", (32, 64), lambda: Int8Product(weight, None, per_row=False))
    store.save()
    assert ProductStore(path).saved["layer"]["info"].tolist()[1:3] == [32, 64]


def test_kinds_of_siblings_come_from_their_saved_products(tmp_path):
    """Which of q/k/v run int4 is read from the saved products' names and kinds, only when they cover exactly these
    layers at these shapes."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=g)
    store = ProductStore(tmp_path / "products.safetensors")
    store.product("layers.0.attn.q_proj+k_proj", (48, 64), lambda: Int8Product(weight, None, per_row=False))
    store.product("layers.0.attn.v_proj", (16, 64), lambda: Int4Product(four_bit(weight[:16]), None)
                  if int4_rows_available() else Int8Product(weight[:16], None, per_row=False))
    store.product("layers.10.attn.q_proj+k_proj", (48, 64), lambda: Int8Product(weight, None, per_row=False))
    store.save()
    store = ProductStore(tmp_path / "products.safetensors")
    shapes = {"q_proj": (32, 64), "k_proj": (16, 64), "v_proj": (16, 64)}
    assert store.kinds("layers.0.attn.", shapes) == {"q_proj": "int8", "k_proj": "int8",
                                                     "v_proj": "int4" if int4_rows_available() else "int8"}
    assert store.kinds("layers.1.", shapes) is None  # layers.10 is another module
    assert store.kinds("layers.0.attn.", {**shapes, "q_proj": (24, 64)}) is None  # another shape
    assert store.kinds("layers.0.attn.", {**shapes, "o_proj": (64, 64)}) is None  # o_proj not saved


def test_a_target_to_quantize_loads_as_stored_and_decodes_as_if_converted_first(tmp_path, monkeypatch):
    """The loader maps a bf16 checkpoint to be quantized as bf16 and makes only the rest fp32: the model equals the
    one loaded in fp32 and then quantized (without any store), logit for logit."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from eagle_fsd.model import EaFsdModel
    from eagle_fsd.target_quant import cpu_activation_bits

    monkeypatch.setenv("EAGLE_FSD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "bf16-model"
    saved_model(folder).to(torch.bfloat16).save_pretrained(folder)
    words = Tokenizer(models.WordLevel({**{f"t{i}": i for i in range(999)}, "[UNK]": 999}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(folder)
    model = EaFsdModel.from_pretrained(str(folder), target_quant="int8").base_model
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     attn_implementation="eagle_fsd").eval()
    format_weights(converted, WeightFormat("rows", activation_bits=cpu_activation_bits()))
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16  # mapped as stored, read by no product
    assert model.model.norm.weight.dtype == torch.float32 and model.dtype == torch.float32
    assert torch.equal(logits(model), logits(converted))


def test_files_of_replaced_weights_are_dropped_and_no_others(tmp_path, monkeypatch):
    """Saving products for a folder whose weight files changed deletes that folder's older files (they can never
    serve again), keeps its files for other settings made from the current weights, and another folder's files."""
    monkeypatch.setenv("EAGLE_FSD_CACHE", str(tmp_path / "cache"))
    first = saved_model(tmp_path / "a" / "model")
    namesake = saved_model(tmp_path / "b" / "model", seed=4)  # same folder name, other weights
    format_cached(namesake, SETTINGS["target"])
    old_target = products_path(first, SETTINGS["target"])
    format_cached(first, SETTINGS["target"])
    weights = tmp_path / "a" / "model" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))  # fetched again
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "model", attn_implementation="eagle_fsd").eval()
    other_settings = products_path(again, SETTINGS["drafter-int8"])
    format_cached(again, SETTINGS["drafter-int8"])
    assert other_settings.is_file() and not old_target.is_file()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "model", attn_implementation="eagle_fsd").eval()
    format_cached(again, SETTINGS["target"])
    assert other_settings.is_file() and products_path(again, SETTINGS["target"]).is_file()
    assert products_path(namesake, SETTINGS["target"]).is_file()
