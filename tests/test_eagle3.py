"""EAGLE-3 heads (eagle_fsd.eagle3): the three checkpoint layouts, the head's forward against a float64 reference of the
published equations written here with plain torch ops, export round trips, and the loader's errors.

Target: a tiny seeded 8-layer Llama (default features: the inputs of layers 2, 4, 5); heads: random, hidden 64, 4 q /
2 KV heads, 100 draft ids of 1000. SpecForge's head is a second oracle (`pip install --no-deps specforge==0.2.0`).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eagle_fsd.cache import TreeCache
from eagle_fsd.drafting.eagle3 import (Eagle3Head, aux_hidden_indices, detect_layout, is_eagle3, load_eagle3_head,
                              read_format)
from eagle_fsd.eagle3_export import export_config, save_eagle3_head
from eagle_fsd.hf import causal_mask
from eagle_fsd.tree.shape import TreeShape
from tiny import tiny_model

H, V, DV, N_LAYERS = 64, 1000, 100, 8
HEAD_FIELDS = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
TOL = 1e-5
LAYOUTS = ("eagle", "sglang", "speculators")

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- builders
@pytest.fixture(scope="module")
def target():
    return tiny_model(num_hidden_layers=N_LAYERS, seed=1)


def random_head(seed=0, norm_before_residual=False, hidden=H, target_hidden=None):
    """A seeded random head whose norms are not all ones and whose draft vocabulary is 100 sorted target ids."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**HEAD_FIELDS, "hidden_size": hidden}, attn_implementation="eagle_fsd")
    head = Eagle3Head(config, DV, target_hidden, norm_before_residual=norm_before_residual, own_embedding=hidden != H)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):  # every RMSNorm
                param.normal_(1.0, 0.2)
        ids = torch.randperm(V)[:DV].sort().values
        head.d2t.copy_(ids - torch.arange(DV))
        head.t2d.zero_().index_fill_(0, ids, True)
    return head.eval()


VERIFIER = "org/tiny-target"  # the target the speculators config names (the tiny target has no name of its own)


def save_dir(path, head, layout, target):
    save_eagle3_head(head, str(path), layout, target.config, VERIFIER)
    return path


def inputs(seed=0, T=6, width=3 * H, hidden=H):
    torch.manual_seed(seed + 100)
    return torch.randn(1, T, hidden), torch.randn(1, T, width), torch.arange(T)[None], causal_mask(0, T, "cpu")


# ----------------------------------------------------------------------------- the reference (float64, plain ops)
def rms(x, weight, eps=1e-6):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, positions, theta=10000.0):
    """Rotate-half RoPE: x (B, heads, T, d) at positions (T,)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def reference_attention(w, x, positions, mask, heads=4, kv_heads=2):
    B, T, _ = x.shape
    d = w["q"].shape[0] // heads
    q = (x @ w["q"].T).view(B, T, heads, d).transpose(1, 2)
    k = (x @ w["k"].T).view(B, T, kv_heads, d).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    v = (x @ w["v"].T).view(B, T, kv_heads, d).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    q, k = rope(q, positions), rope(k, positions)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask, float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(B, T, heads * d) @ w["o"].T


def reference(state, embeds, hidden, positions, mask, norm_before_residual=False):
    """The published EAGLE-3 step: fc on target features; x = cat(input_ln(e), hidden_norm(h)); h1 = r + attn(x) with
    r = h (or hidden_norm(h)); h' = h1 + mlp(post_ln(h1)); logits = lm_head(norm(h'))."""
    s = {k.removeprefix("midlayer."): v.double() for k, v in state.items() if v.is_floating_point()}
    embeds, hidden = embeds.double(), hidden.double()
    if hidden.shape[-1] != embeds.shape[-1]:
        hidden = hidden @ s["fc.weight"].T
    normed = rms(hidden, s["hidden_norm.weight"])
    residual = normed if norm_before_residual else hidden
    x = torch.cat([rms(embeds, s["input_layernorm.weight"]), normed], dim=-1)
    w = {p: s[f"self_attn.{p}_proj.weight"] for p in "qkvo"}
    h1 = residual + reference_attention(w, x, positions[0], mask[0, 0])
    z = rms(h1, s["post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(z @ s["mlp.gate_proj.weight"].T) * (z @ s["mlp.up_proj.weight"].T))
    out = h1 + mlp @ s["mlp.down_proj.weight"].T
    return out, rms(out, s["norm.weight"]) @ s["lm_head.weight"].T


def assert_matches_reference(head, state, norm_before_residual=False, hidden=H):
    for width in (3 * H, hidden):  # target features, then the draft's own state (no fc)
        embeds, features, positions, mask = inputs(width=width, hidden=hidden)
        with torch.no_grad():
            new_hidden, logits = head(embeds, features, positions, mask)
        want_hidden, want_logits = reference(state, embeds, features, positions, mask, norm_before_residual)
        torch.testing.assert_close(new_hidden.double(), want_hidden, atol=TOL, rtol=TOL)
        torch.testing.assert_close(logits.double(), want_logits, atol=TOL, rtol=TOL)


# ----------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_loads_and_matches_reference(tmp_path, target, layout):
    source = random_head()
    raw = json.loads((save_dir(tmp_path, source, layout, target) / "config.json").read_text())
    assert detect_layout(raw) == layout and is_eagle3(raw)
    head, indices = load_eagle3_head(str(tmp_path), target)
    assert indices == (2, 4, 5)
    assert_matches_reference(head, source.state_dict())
    assert torch.equal(head.draft_to_target_ids(), source.t2d.nonzero().flatten())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_round_trip_identical_forward(tmp_path, target, layout):
    first, _ = load_eagle3_head(str(save_dir(tmp_path / "a", random_head(seed=3), "eagle", target)), target)
    second, _ = load_eagle3_head(str(save_dir(tmp_path / "b", first, layout, target)), target)
    embeds, features, positions, mask = inputs()
    with torch.no_grad():
        for a, b in zip(first(embeds, features, positions, mask), second(embeds, features, positions, mask)):
            assert torch.equal(a, b)
    assert torch.equal(first.d2t, second.d2t) and torch.equal(first.t2d, second.t2d)


def test_weight_names_per_layout(tmp_path, target):
    head = random_head()
    for layout, layer in (("eagle", "midlayer."), ("sglang", "midlayer."), ("speculators", "layers.0.")):
        keys = set(load_file(save_dir(tmp_path / layout, head, layout, target) / "model.safetensors"))
        assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys
        assert f"{layer}hidden_norm.weight" in keys and f"{layer}self_attn.q_proj.weight" in keys
        assert tuple(load_file(tmp_path / layout / "model.safetensors")["fc.weight"].shape) == (H, 3 * H)


def test_sglang_model_prefix_and_pytorch_bin(tmp_path, target):
    source = random_head(seed=4)
    save_dir(tmp_path, source, "sglang", target)
    state = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    torch.save({"model." + k: v for k, v in state.items()}, tmp_path / "pytorch_model.bin")
    head, _ = load_eagle3_head(str(tmp_path), target)
    assert_matches_reference(head, source.state_dict())


def test_norm_before_residual_speculators(tmp_path, target):
    source = random_head(seed=5, norm_before_residual=True)
    head, _ = load_eagle3_head(str(save_dir(tmp_path, source, "speculators", target)), target)
    assert head.midlayer.norm_before_residual
    assert_matches_reference(head, source.state_dict(), norm_before_residual=True)
    with pytest.raises(ValueError, match="norm_before_residual"):
        save_eagle3_head(source, str(tmp_path / "e"), "eagle", target.config)


def test_speculators_config_names_the_verifier(tmp_path, target):
    """vLLM serves a speculators folder by loading speculators_config.verifier.name_or_path: never null."""
    head = random_head()
    config = json.loads((save_dir(tmp_path / "given", head, "speculators", target) / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == VERIFIER
    named = LlamaConfig(**HEAD_FIELDS, name_or_path="/models/target")
    assert export_config(head, "speculators", named)["speculators_config"]["verifier"]["name_or_path"] == \
        "/models/target"
    with pytest.raises(ValueError, match="verifier="):
        save_eagle3_head(head, str(tmp_path / "none"), "speculators", target.config)


def test_train_head_names_the_verifier_a_server_can_load(tmp_path):
    from eagle_fsd.presets import serving_name

    assert serving_name("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert serving_name("Org/Model-7B") == "Org/Model-7B"
    assert serving_name(str(tmp_path)) == str(tmp_path.resolve())


def test_fc_bias_exported_for_sglang_only(tmp_path, target):
    """SGLang: fc bias = config.bias, and its Llama attention gives o_proj a bias under the same flag (written as
    zeros); SafeAILab and vLLM build fc without a bias, so those layouts refuse the head."""
    source = random_head(seed=9)
    source.fc = torch.nn.Linear(3 * H, H, bias=True)
    torch.nn.init.normal_(source.fc.bias)
    config = json.loads((save_dir(tmp_path, source, "sglang", target) / "config.json").read_text())
    assert config["bias"] is True
    state = load_file(tmp_path / "model.safetensors")
    assert torch.equal(state["midlayer.self_attn.o_proj.bias"], torch.zeros(H))
    head, _ = load_eagle3_head(str(tmp_path), target)
    embeds, features, positions, mask = inputs()
    with torch.no_grad():
        for a, b in zip(source(embeds, features, positions, mask), head(embeds, features, positions, mask)):
            assert torch.equal(a, b)
    for layout in ("eagle", "speculators"):
        with pytest.raises(ValueError, match="bias on fc.*'sglang'"):
            save_dir(tmp_path / layout, source, layout, target)


def test_head_with_own_hidden_size_and_embedding(tmp_path, target):
    source = random_head(seed=6, hidden=32, target_hidden=H)
    assert tuple(source.fc.weight.shape) == (32, 3 * H)
    for layout in LAYOUTS:
        head, _ = load_eagle3_head(str(save_dir(tmp_path / layout, source, layout, target)), target)
        assert head.embed_tokens is not None and head.target_hidden_size == H
        assert_matches_reference(head, source.state_dict(), hidden=32)


def test_full_vocabulary_head_takes_target_lm_head(tmp_path, target):
    """SGLang: no draft_vocab_size -> draft over the full vocabulary with the target's lm_head, identity ids."""
    save_dir(tmp_path, random_head(seed=7), "sglang", target)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["draft_vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in state.items() if k not in ("lm_head.weight", "d2t", "t2d")},
              tmp_path / "model.safetensors")
    head, _ = load_eagle3_head(str(tmp_path), target)
    assert torch.equal(head.lm_head.weight, target.get_output_embeddings().weight)
    assert torch.equal(head.draft_to_target_ids(), torch.arange(V)) and bool(head.t2d.all())


def test_kv_cache_in_two_chunks_equals_one_forward():
    head = random_head(seed=8)
    embeds, features, positions, mask = inputs(T=7)
    with torch.no_grad():
        whole = head(embeds, features, positions, mask)
        cache = TreeCache(1, 16)
        first = head(embeds[:, :4], features[:, :4], positions[:, :4], causal_mask(0, 4, "cpu"), cache)
        second = head(embeds[:, 4:], features[:, 4:], positions[:, 4:], causal_mask(4, 3, "cpu"), cache)
    for part_a, part_b, full in zip(first, second, whole):
        torch.testing.assert_close(torch.cat([part_a, part_b], dim=1), full, atol=TOL, rtol=TOL)


def test_loader_casts_to_target_dtype(tmp_path):
    target16 = tiny_model(num_hidden_layers=N_LAYERS, seed=1).to(torch.bfloat16)
    head, _ = load_eagle3_head(str(save_dir(tmp_path, random_head(), "eagle", target16)), target16)
    assert head.fc.weight.dtype == head.lm_head.weight.dtype == torch.bfloat16
    assert head.rotary_emb.inv_freq.dtype == torch.float32
    assert head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool


# ----------------------------------------------------------------------------- aux layers
@pytest.mark.parametrize("layout, ids, want", [
    ("sglang", [1, 3, 5], (2, 4, 6)),        # SpecForge: outputs of layers 1, 3, 5
    ("sglang", [2, 4, 6], (2, 4, 6)),        # sglang PR #25454: lists starting at 2 are inputs already
    ("speculators", [2, 4, 6], (2, 4, 6)),   # vLLM: inputs of layers
    ("speculators", [1, 3, 8], (1, 3, 8)),   # id N: the last layer's output
])
def test_aux_layer_ids_to_hidden_state_indices(target, layout, ids, want):
    config = export_config(random_head(), layout, verifier=VERIFIER)
    (config["eagle_config"] if layout == "sglang" else config)["eagle_aux_hidden_state_layer_ids"] = ids
    assert aux_hidden_indices(read_format(config), N_LAYERS) == want


def test_reads_published_safeailab_config():
    """eagle/traineagle3/config.json of SafeAILab/EAGLE (the yuhuili/EAGLE3-LLaMA3.1 head): no rope_theta -> 10000."""
    fmt = read_format({
        "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
        "transformers_version": "4.28.1", "vocab_size": 128256, "draft_vocab_size": 32000})
    assert (fmt.layout, fmt.draft_vocab_size, fmt.target_hidden_size, fmt.config.head_dim) == \
        ("eagle", 32000, 4096, 128)
    assert fmt.config.rope_parameters["rope_theta"] == 10000 and aux_hidden_indices(fmt, 32) == (2, 16, 29)


@pytest.mark.parametrize("layout, indices", [("sglang", (2, 5, 6)), ("sglang", (3, 5, 7)),
                                             ("speculators", (1, 4, 8))])
def test_non_default_layers_round_trip(tmp_path, target, layout, indices):
    head = random_head()
    head.aux_hidden_indices = indices
    _, got = load_eagle3_head(str(save_dir(tmp_path, head, layout, target)), target)
    assert got == indices


def test_non_default_layers_refused_where_not_spellable(tmp_path, target):
    head = random_head()
    head.aux_hidden_indices = (2, 5, 6)
    with pytest.raises(ValueError, match="default layers"):
        save_eagle3_head(head, str(tmp_path / "e"), "eagle", target.config)
    head.aux_hidden_indices = (1, 4, 6)
    with pytest.raises(ValueError, match="no SGLang spelling"):
        save_eagle3_head(head, str(tmp_path / "s"), "sglang", target.config)
    with pytest.raises(ValueError, match="layout="):
        save_eagle3_head(head, str(tmp_path / "x"), "vllm", target.config)


# ----------------------------------------------------------------------------- errors
def edited(tmp_path, target, config_edit=None, state_edit=None, layout="sglang", head=None):
    """A saved random head with its config.json / weights changed; returns its directory as str."""
    save_dir(tmp_path, head or random_head(), layout, target)
    if config_edit is not None:
        config = json.loads((tmp_path / "config.json").read_text())
        config_edit(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
    if state_edit is not None:
        state = load_file(tmp_path / "model.safetensors")
        state_edit(state)
        save_file(state, tmp_path / "model.safetensors")
    return str(tmp_path)


def test_error_own_hidden_size_without_embedding(tmp_path, target):
    path = edited(tmp_path, target, state_edit=lambda s: s.pop("embed_tokens.weight"),
                  head=random_head(hidden=32, target_hidden=H))
    with pytest.raises(ValueError, match="hidden_size 32 != the target's 64 but no embed_tokens.weight"):
        load_eagle3_head(path, target)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(t2d=s["t2d"][:999].clone()), "t2d covers 999 target ids but the target's vocabulary has 1000"),
    (lambda s: s.update(d2t=s["d2t"] + V * (torch.arange(DV) == DV - 1)),
     r"d2t maps draft ids to target ids in \[\d+, \d+\], outside .*\[0, 1000\)"),
])
def test_error_draft_vocabulary_does_not_fit(tmp_path, target, edit, message):
    with pytest.raises(ValueError, match=message):
        load_eagle3_head(edited(tmp_path, target, state_edit=edit), target)


@pytest.mark.parametrize("layout, ids", [("sglang", [1, 3, 8]), ("speculators", [2, 4, 9]),
                                         ("speculators", [-1, 3, 5]), ("speculators", [2, 2, 5])])
def test_error_aux_layer_ids_out_of_range(tmp_path, target, layout, ids):
    def set_ids(config):
        (config["eagle_config"] if layout == "sglang" else config)["eagle_aux_hidden_state_layer_ids"] = ids

    with pytest.raises(ValueError, match=r"must be distinct and within \[0, 8\] for a target with num_hidden_layers"):
        load_eagle3_head(edited(tmp_path, target, set_ids, layout=layout), target)


def test_error_default_layers_need_a_deeper_target(tmp_path):
    shallow = tiny_model(num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"indices \(2, 1, -1\)"):
        load_eagle3_head(str(save_dir(tmp_path, random_head(), "eagle", shallow)), shallow)


def test_error_unknown_layout(tmp_path, target):
    def not_eagle3(config):
        config["architectures"] = ["MistralForCausalLM"]

    with pytest.raises(ValueError, match="is no EAGLE-3 head this loader knows.*MistralForCausalLM"):
        load_eagle3_head(edited(tmp_path, target, not_eagle3), target)
    assert not is_eagle3({"architectures": ["LlamaForCausalLM"], "vocab_size": V})


@pytest.mark.parametrize("key", ["fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t"])
def test_error_missing_weight(tmp_path, target, key):
    with pytest.raises(ValueError, match=rf"missing \[.*'{key}'"):
        load_eagle3_head(edited(tmp_path, target, state_edit=lambda s: s.pop(key)), target)


def test_error_unexpected_and_misshapen_weights(tmp_path, target):
    path = edited(tmp_path / "u", target, state_edit=lambda s: s.update({"midlayer.extra.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"unexpected \['midlayer.extra.weight'\]"):
        load_eagle3_head(path, target)
    path = edited(tmp_path / "s", target, state_edit=lambda s: s.update({"fc.weight": torch.ones(H, 2 * H)}))
    with pytest.raises(ValueError, match="does not fit the sglang layout"):
        load_eagle3_head(path, target)
    path = edited(tmp_path / "l", target, state_edit=lambda s: s.update({"layers.1.hidden_norm.weight": torch.ones(H)}))
    with pytest.raises(ValueError, match="second decoder layer"):
        load_eagle3_head(path, target)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(vocab_size=2000), "vocab_size 2000 but the target has 1000"),
    (lambda c: c.update(target_hidden_size=32), "target hidden states of size 32 but the target has hidden_size 64"),
    (lambda c: c.update(norm_before_fc=True), "norm_before_fc=true"),
    (lambda c: c.update(num_hidden_layers=2), "num_hidden_layers=2"),
    (lambda c: c.update(model_type="qwen3"), "'qwen3' decoder layer"),
])
def test_error_config_does_not_fit(tmp_path, target, edit, message):
    with pytest.raises(ValueError, match=message):
        load_eagle3_head(edited(tmp_path, target, edit), target)


def test_error_missing_files(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_eagle3_head(str(tmp_path / "nowhere"), target)
    save_dir(tmp_path, random_head(), "eagle", target)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor pytorch_model.bin"):
        load_eagle3_head(str(tmp_path), target)


def test_error_hidden_width(target):
    embeds, features, positions, mask = inputs(width=2 * H)
    with pytest.raises(ValueError, match=f"width {3 * H} .* or {H} .*got {2 * H}"):
        random_head()(embeds, features, positions, mask)


# ----------------------------------------------------------------------------- SpecForge as a second oracle
def test_matches_specforge_head(tmp_path, target):
    """SpecForge 0.2.0's LlamaForCausalLMEagle3 (the trainer of SGLang-layout heads) on the same weights."""
    specforge = pytest.importorskip("specforge.modeling.draft.llama3_eagle")
    save_dir(tmp_path, random_head(seed=9), "sglang", target)
    head, _ = load_eagle3_head(str(tmp_path), target)
    config = LlamaConfig(**HEAD_FIELDS, draft_vocab_size=DV)
    theirs = specforge.LlamaForCausalLMEagle3(config).eval()
    state = load_file(tmp_path / "model.safetensors")
    theirs.load_state_dict({**state, "embed_tokens.weight": target.get_input_embeddings().weight}, strict=True)
    embeds, features, positions, mask = inputs(T=9)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):  # their RoPE is torch.compile'd
        their_normed = theirs(features, embeds)
        new_hidden, logits = head(embeds, features, positions, mask)
    torch.testing.assert_close(head.norm(new_hidden), their_normed, atol=TOL, rtol=TOL)
    torch.testing.assert_close(logits, theirs.lm_head(their_normed), atol=TOL, rtol=TOL)
    assert torch.equal(theirs.d2t, head.d2t) and torch.equal(theirs.t2d, head.t2d)


# ----------------------------------------------------------------------------- drafter sketch
def test_drafter_grows_a_tree_over_the_draft_vocabulary(tmp_path, target):
    from eagle_fsd.drafting import grow_tree
    from eagle_fsd.drafting.eagle3 import Eagle3Drafter, aux_features

    head, indices = load_eagle3_head(str(save_dir(tmp_path, random_head(seed=10), "eagle", target)), target)
    prompt = torch.tensor([5, 17, 99, 3, 250, 41])
    with torch.no_grad():
        hidden_states = target(prompt[None], output_hidden_states=True).hidden_states
        features = aux_features(hidden_states, indices)[0]
        root = torch.tensor(7)
        drafter = Eagle3Drafter(head, target)
        drafter.reset(64)
        root_logits, root_state = drafter.prefill(prompt, root, features)
        want_hidden, want_logits = head(target.get_input_embeddings()(torch.cat([prompt[1:], root[None]]))[None],
                                        features[None], torch.arange(6)[None], causal_mask(0, 6, "cpu"))
        tree = grow_tree(drafter, root, root_logits, root_state, TreeShape(12, 3, 3))
    torch.testing.assert_close(root_logits, want_logits[0, -1], atol=TOL, rtol=TOL)
    torch.testing.assert_close(root_state, want_hidden[0, -1], atol=TOL, rtol=TOL)
    assert tree.size == 12 and drafter.cache.get_seq_length() == drafter.length == 6
    assert bool(torch.isin(tree.tokens[1:], head.draft_to_target_ids()).all())
