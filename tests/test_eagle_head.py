"""EAGLE-1/2 draft head (`EagleHead`), its loader (`load_eagle_head`) and `EagleDrafter`.

The reference is SafeAILab's own code, `eagle.model.cnets.Model` from `eagle-llm==1.2.1` (installed with --no-deps; the
tests that need it are skipped without it). Under transformers 5 it needs one shim: `config.rope_scaling` must be None
(transformers 5 always fills it, eagle then reads `rope_scaling["type"]`), so `cfg.rope_parameters = None` before
`Model(cfg)`. eagle-llm 1.2.1 hard-codes RoPE base 10000, so every config here keeps the default rope_theta.
All models are tiny (hidden 64, 4 query / 2 KV heads, vocab 1000), fp32, eval mode.
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import eagle_fsd.attention  # noqa: F401  (registers the "eagle_fsd" attention function)
from eagle_fsd.cache import TreeCache
from eagle_fsd.drafting import EagleDrafter, EagleHead, head_config, load_eagle_head
from eagle_fsd.hf import causal_mask, prefix_tree_mask
from eagle_fsd.model import EaFsdModel
from eagle_fsd.tree.dynamic import next_level_mask

H, V = 64, 1000
HEAD_RAW = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu")
TOL = 1e-5

# eagle's EConfig passes rope_scaling=None, which transformers 5 reports as deprecated
pytestmark = [pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning"),
              pytest.mark.usefixtures("one_thread")]


# ----------------------------------------------------------------------------- builders
def make_eagle(seed=0, bias=True, qkv_bias=False, embed=None):
    """eagle-llm's reference head on seeded random weights (eval mode). qkv_bias: give q/k/v a bias (Qwen2-style, as
    EAGLE-2's cnets does for `config.qkv_bias`; eagle-llm 1.2.1 predates that, so the Linear modules are swapped)."""
    cnets = pytest.importorskip("eagle.model.cnets")
    from eagle.model.configs import EConfig

    cfg = EConfig(**HEAD_RAW)
    cfg.rope_parameters = None  # shim: transformers 5 fills rope_scaling; eagle expects None
    assert cfg.rope_scaling is None
    torch.manual_seed(seed)
    model = cnets.Model(cfg, bias=bias)
    with torch.no_grad():
        model.layers[0].post_attention_layernorm.weight.normal_(1.0, 0.2)  # not all ones, so the norm weight matters
        if embed is not None:
            model.embed_tokens.weight.copy_(embed)
        if qkv_bias:
            attn = model.layers[0].self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(attn, name)
                new = nn.Linear(old.in_features, old.out_features, bias=True)
                new.weight.copy_(old.weight)
                new.bias.normal_(0.0, 0.5)
                setattr(attn, name, new)
    return model.eval()  # train mode would take eagle's gradient-checkpointing branch (no KV)


def head_cfg(attn="eagle_fsd", **over):
    cfg = LlamaConfig(**{**HEAD_RAW, **over})
    cfg._attn_implementation = attn
    return cfg


def ours_from(eagle_model, attn="eagle_fsd", qkv_bias=False):
    head = EagleHead(head_cfg(attn), bias=eagle_model.fc.bias is not None, qkv_bias=qkv_bias).eval()
    state = {k: v for k, v in eagle_model.state_dict().items() if k != "embed_tokens.weight"}
    head.load_state_dict(state, strict=True)
    return head


def make_target(seed=1, layers=2, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**HEAD_RAW, "num_hidden_layers": layers}, attn_implementation="eagle_fsd")
    return LlamaForCausalLM(cfg).to(dtype).eval()


def write_head(path, state, config, fmt="bin"):
    """A head directory in the published EAGLE-1/2 layout: config.json + pytorch_model.bin or model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    state = {k: v.detach().clone().contiguous() for k, v in state.items()}
    if fmt == "bin":
        torch.save(state, path / "pytorch_model.bin")
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path / "model.safetensors"))
    return str(path)


def published_config(bias=True, **extra):
    # What released heads ship: a LLaMA config with num_hidden_layers 1 (+ "bias"; Vicuna heads have no "bias" key).
    config = dict(HEAD_RAW, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float32",
                  transformers_version="4.28.1", tie_word_embeddings=False, use_cache=True, pretraining_tp=1,
                  rope_scaling=None, initializer_range=0.02)
    if bias is not None:
        config["bias"] = bias
    config.update(extra)
    return config


def our_published_state(target, seed=3, bias=True, qkv_bias=False):
    """A published-layout state dict made with our own head (no eagle-llm needed): our keys + embed_tokens.weight."""
    torch.manual_seed(seed)
    head = EagleHead(head_cfg("sdpa"), bias=bias, qkv_bias=qkv_bias)
    state = dict(head.state_dict())
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    return state


@pytest.fixture(scope="module")
def target():
    return make_target()


# ----------------------------------------------------------------------------- 1. parity with eagle-llm
@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_keys_match_eagle_checkpoint(bias):
    eagle_model = make_eagle(bias=bias)
    ours = EagleHead(head_cfg(), bias=bias)
    eagle_keys = set(eagle_model.state_dict())
    assert "embed_tokens.weight" in eagle_keys
    assert set(ours.state_dict()) == eagle_keys - {"embed_tokens.weight"}
    for k, v in ours.state_dict().items():
        assert v.shape == eagle_model.state_dict()[k].shape, k
    assert ("fc.bias" in eagle_keys) == bias
    # EAGLE's layer 0 has no input_layernorm: nothing to load for it, and ours is an identity
    assert isinstance(ours.layers[0].input_layernorm, nn.Identity)


@pytest.mark.parametrize("attn", ["eagle_fsd", "sdpa", "eager"])
@pytest.mark.parametrize("bias", [True, False])
def test_full_sequence_parity(attn, bias):
    eagle_model = make_eagle(bias=bias)
    ours = ours_from(eagle_model, attn=attn)
    torch.manual_seed(5)
    B, T = 2, 9
    ids = torch.randint(0, V, (B, T))
    feats = torch.randn(B, T, H)
    mask = causal_mask(0, T, "cpu")
    if attn == "eager":  # the eager implementation adds the mask: give it the additive float form
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref = eagle_model(feats, ids)
        out = ours(eagle_model.embed_tokens(ids), feats, torch.arange(T).expand(B, T), mask)
    assert out.shape == (B, T, H)
    assert (out - ref).abs().max() <= TOL


def test_kv_cache_incremental_parity():
    """Prefix, then 3 tokens, then 1 token on top of the cache: outputs and the cached K/V equal eagle's."""
    eagle_model = make_eagle()
    ours = ours_from(eagle_model)
    emb = eagle_model.embed_tokens
    torch.manual_seed(6)
    chunks = [7, 3, 1]
    ids = torch.randint(0, V, (1, sum(chunks)))
    feats = torch.randn(1, sum(chunks), H)
    cache = TreeCache(1, 32)
    kv, start = None, 0
    with torch.no_grad():
        for n in chunks:
            sl = slice(start, start + n)
            ref, kv = eagle_model(feats[:, sl], ids[:, sl], past_key_values=kv, use_cache=True)
            out = ours(emb(ids[:, sl]), feats[:, sl], (start + torch.arange(n))[None], causal_mask(start, n, "cpu"),
                       cache)
            start += n
            assert (out - ref).abs().max() <= TOL
            assert cache.get_seq_length() == start
            # same KV layout (B, H_kv, S, D), RoPE already applied to the keys
            keys, values = kv[0]
            assert keys.shape == (1, 2, start, H // 4)
            assert (cache.layers[0].keys[:, :, :start] - keys).abs().max() <= TOL
            assert (cache.layers[0].values[:, :, :start] - values).abs().max() <= TOL
        # and the incremental result equals one full forward
        full = ours(emb(ids), feats, torch.arange(start)[None], causal_mask(0, start, "cpu"))
    assert (full[:, -1:] - out).abs().max() <= TOL


def _ancestor_mask(parents):
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def test_tree_mask_parity():
    """A 7-node tree on top of a 6-token prefix: eagle's `tree_mask` attribute vs our 4-D bool mask."""
    eagle_model = make_eagle()
    ours = ours_from(eagle_model)
    emb = eagle_model.embed_tokens
    parents = [-1, 0, 0, 1, 1, 2, 3]
    tree = _ancestor_mask(parents)
    depths = tree.sum(1) - 1
    torch.manual_seed(7)
    P, N = 6, len(parents)
    ids = torch.randint(0, V, (1, P + N))
    feats = torch.randn(1, P + N, H)
    cache = TreeCache(1, 32)
    with torch.no_grad():
        _, kv = eagle_model(feats[:, :P], ids[:, :P], use_cache=True)
        ours(emb(ids[:, :P]), feats[:, :P], torch.arange(P)[None], causal_mask(0, P, "cpu"), cache)
        eagle_model.tree_mask = tree.float()[None, None]
        ref, _ = eagle_model(feats[:, P:], ids[:, P:], past_key_values=kv, position_ids=(P + depths)[None],
                             use_cache=True)
        eagle_model.tree_mask = None
        out = ours(emb(ids[:, P:]), feats[:, P:], (P + depths)[None], prefix_tree_mask(P, tree), cache)
        assert (out - ref).abs().max() <= TOL
        # each node equals a plain causal forward of prefix + its root->node path
        for node in range(N):
            path = [i for i in range(N) if tree[node, i]]
            sel = list(range(P)) + [P + i for i in path]
            alone = ours(emb(ids[:, sel]), feats[:, sel], torch.arange(len(sel))[None], causal_mask(0, len(sel), "cpu"))
            assert (alone[0, -1] - out[0, node]).abs().max() <= TOL


def test_drafter_matches_eagle_draft_steps(target):
    """EagleDrafter's catch-up, two tree levels, rollback and next catch-up == eagle's forward with its stable KV,
    `tree_mask` per level and EAGLE's positions (shifted inputs; every node of level s at position len + s)."""
    eagle_model = make_eagle(embed=target.get_input_embeddings().weight)
    head = ours_from(eagle_model)
    drafter = EagleDrafter(head, target)
    lm_head = target.get_output_embeddings()
    torch.manual_seed(8)
    prompt = torch.randint(0, V, (10,))
    root = torch.tensor(17)
    hidden = torch.randn(10, H)
    k = 3

    def ref_logits(x):  # the drafter hands out raw draft logits (log-probs only for the top-k, in grow_pool)
        return lm_head(x).float()

    with torch.no_grad():
        drafter.reset(64)
        logp, state = drafter.prefill(prompt, root, hidden)
        shifted = torch.cat([prompt[1:], root.reshape(1)])
        ref, stable_kv = eagle_model(hidden[None], shifted[None], use_cache=True)
        assert drafter.length == 10 == shifted.numel()
        assert (state - ref[0, -1]).abs().max() <= TOL
        assert (logp - ref_logits(ref[0, -1])).abs().max() <= TOL

        # level 0: the root's top-k children, all fed the root's draft state
        tokens0 = logp.topk(k).indices
        mask0 = torch.eye(k, dtype=torch.bool)
        logp0, states0 = drafter.forward_level(tokens0, state[None].expand(k, -1), 0, mask0)
        eagle_model.tree_mask = mask0.float()[None, None]
        ref0, kv = eagle_model(state[None, None].expand(1, k, H), tokens0[None], past_key_values=stable_kv,
                               position_ids=torch.full((1, k), 10), use_cache=True)
        assert (states0 - ref0[0]).abs().max() <= TOL
        assert (logp0 - ref_logits(ref0[0])).abs().max() <= TOL

        # level 1: rows 2, 0, 0 expanded (mask row = parent's row + self)
        rows = torch.tensor([2, 0, 0])
        tokens1 = torch.tensor([5, 6, 7])
        mask1 = next_level_mask(mask0, rows)
        assert mask1.shape == (k, 2 * k)
        logp1, states1 = drafter.forward_level(tokens1, states0[rows], 1, mask1)
        eagle_model.tree_mask = mask1.float()[None, None]
        ref1, _ = eagle_model(ref0[:, rows], tokens1[None], past_key_values=kv, position_ids=torch.full((1, k), 11),
                              use_cache=True)
        assert (states1 - ref1[0]).abs().max() <= TOL
        assert (logp1 - ref_logits(ref1[0])).abs().max() <= TOL

        # rollback drops the levels; the next catch-up reads the accepted tokens on top of the stable KV only
        drafter.rollback()
        assert drafter.cache.get_seq_length() == 10
        eagle_model.tree_mask = None
        new = torch.tensor([tokens0[2].item(), 5, 9])
        new_hidden = torch.randn(3, H)
        logp2, state2 = drafter.extend(new, new_hidden)
        ref2, _ = eagle_model(new_hidden[None], new[None], past_key_values=stable_kv, use_cache=True)
        assert drafter.length == 13
        assert (state2 - ref2[0, -1]).abs().max() <= TOL
        assert (logp2 - ref_logits(ref2[0, -1])).abs().max() <= TOL


# ----------------------------------------------------------------------------- 2. loader round trip
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("bias", [True, False, None])  # None: no "bias" key (Vicuna/LLaMA-2 heads) -> fc has a bias
def test_loader_round_trip(tmp_path, target, fmt, bias):
    eagle_model = make_eagle(bias=bias is not False, embed=target.get_input_embeddings().weight)
    state = eagle_model.state_dict()
    assert "embed_tokens.weight" in state
    path = write_head(tmp_path / "head", state, published_config(bias=bias), fmt)
    head = load_eagle_head(path, target)
    assert isinstance(head, EagleHead) and not head.training
    assert head.config._attn_implementation == "eagle_fsd"
    assert head.config.num_hidden_layers == 1
    assert (head.fc.bias is not None) == (bias is not False)
    assert head.fc.weight.dtype == target.dtype
    torch.manual_seed(9)
    ids = torch.randint(0, V, (1, 8))
    feats = torch.randn(1, 8, H)
    with torch.no_grad():
        ref = eagle_model(feats, ids)
        out = head(target.get_input_embeddings()(ids), feats, torch.arange(8)[None], causal_mask(0, 8, "cpu"))
    assert (out - ref).abs().max() <= TOL


def test_loader_prefers_safetensors(tmp_path, target):
    good = our_published_state(target, seed=3)
    other = our_published_state(target, seed=4)
    path = write_head(tmp_path / "head", good, published_config(), "safetensors")
    write_head(tmp_path / "head", other, None, "bin")
    head = load_eagle_head(path, target)
    assert torch.equal(head.fc.weight, good["fc.weight"])


def test_loader_casts_fp16_checkpoint_to_target_dtype(tmp_path, target):
    # released heads are fp16
    state = {k: v.half() for k, v in our_published_state(target).items()}
    head = load_eagle_head(write_head(tmp_path / "head", state, published_config(torch_dtype="float16")), target)
    for name, p in head.named_parameters():
        assert p.dtype == torch.float32, name
    assert torch.equal(head.fc.weight, state["fc.weight"].float())


def test_head_config_reads_published_fields():
    cfg, bias, qkv_bias = head_config(published_config(bias=False, rope_theta=500000.0, rms_norm_eps=1e-5))
    assert (bias, qkv_bias) == (False, False)
    assert cfg.num_hidden_layers == 1 and cfg.hidden_size == H and cfg.vocab_size == V
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.rope_parameters["rope_theta"] == 500000.0  # LLaMA-3 heads: RoPE base from the head config
    assert head_config(published_config(bias=None))[1] is True
    assert head_config(published_config(qkv_bias=True))[2] is True


def test_loaded_head_keeps_fp32_rope_frequencies(tmp_path):
    target = make_target(layers=1, dtype=torch.float32)
    state = our_published_state(target)
    target = target.to(torch.bfloat16)
    head = load_eagle_head(write_head(tmp_path / "head", state, published_config()), target)
    assert head.fc.weight.dtype == torch.bfloat16
    fresh = 1.0 / (10000.0 ** (torch.arange(0, H // 4, 2, dtype=torch.float) / (H // 4)))
    assert head.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(head.rotary_emb.inv_freq, fresh)


# ----------------------------------------------------------------------------- 3. clear errors
def test_error_hidden_size_mismatch(tmp_path, target):
    state = our_published_state(target)
    path = write_head(tmp_path / "head", state, published_config(hidden_size=32))
    with pytest.raises(ValueError, match=r"hidden_size 32 but the target has 64"):
        load_eagle_head(path, target)


def test_error_vocab_mismatch(tmp_path, target):
    state = our_published_state(target)
    path = write_head(tmp_path / "head", state, published_config(vocab_size=32000))
    with pytest.raises(ValueError, match=r"vocab_size 32000 but the target has 1000"):
        load_eagle_head(path, target)


def test_error_embedding_shape_mismatch(tmp_path, target):
    state = our_published_state(target)
    state["embed_tokens.weight"] = torch.zeros(999, H)
    path = write_head(tmp_path / "head", state, published_config())
    with pytest.raises(ValueError, match=r"embedding shape \(999, 64\)"):
        load_eagle_head(path, target)


def test_error_missing_weights_file(tmp_path, target):
    path = write_head(tmp_path / "head", {}, published_config(), fmt=None)
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor pytorch_model\.bin"):
        load_eagle_head(path, target)


def test_error_missing_config(tmp_path, target):
    path = write_head(tmp_path / "head", our_published_state(target), None)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_eagle_head(path, target)


def test_error_nonexistent_path(target):
    with pytest.raises(FileNotFoundError, match=r"directory '/nonexistent/eagle-head-dir' does not exist"):
        load_eagle_head("/nonexistent/eagle-head-dir", target)


def test_error_missing_key(tmp_path, target):
    state = our_published_state(target)
    del state["fc.weight"]
    path = write_head(tmp_path / "head", state, published_config())
    with pytest.raises(ValueError, match=r"missing \['fc\.weight'\]"):
        load_eagle_head(path, target)


def test_error_unexpected_key(tmp_path, target):
    # an EAGLE-3 / full-model style extra tensor must not be silently ignored
    state = our_published_state(target)
    state["layers.0.input_layernorm.weight"] = torch.ones(H)
    path = write_head(tmp_path / "head", state, published_config())
    with pytest.raises(ValueError, match=r"unexpected \['layers\.0\.input_layernorm\.weight'\]"):
        load_eagle_head(path, target)


def test_error_bias_flag_disagrees_with_weights(tmp_path, target):
    # config says "bias": false (LLaMA-3 heads) but the checkpoint has fc.bias
    state = our_published_state(target, bias=True)
    path = write_head(tmp_path / "head", state, published_config(bias=False))
    with pytest.raises(ValueError, match=r"unexpected \['fc\.bias'\]"):
        load_eagle_head(path, target)


def test_error_wrong_tensor_shape(tmp_path, target):
    state = our_published_state(target)
    state["fc.weight"] = torch.zeros(H, H)
    path = write_head(tmp_path / "head", state, published_config())
    with pytest.raises(ValueError, match=r"fc\.weight"):
        load_eagle_head(path, target)


def test_drafter_rejects_mismatched_head(target):
    head = EagleHead(head_cfg()).eval()
    with pytest.raises(ValueError, match=r"dtype torch\.float16 != target dtype torch\.float32"):
        EagleDrafter(head.half(), target)
    small = EagleHead(head_cfg(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)).eval()
    with pytest.raises(ValueError, match=r"hidden_size 32 != target's 64"):
        EagleDrafter(small, target)


# ----------------------------------------------------------------------------- 4. end to end (lossless greedy)
PROMPT_LEN, NEW = 12, 30


@pytest.fixture(scope="module")
def prompt():
    torch.manual_seed(10)
    return torch.randint(0, V, (1, PROMPT_LEN))


@pytest.fixture(scope="module")
def target_greedy(target, prompt):
    with torch.no_grad():
        return target.generate(prompt, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)


@pytest.fixture(scope="module")
def random_head(target):
    torch.manual_seed(11)
    return EagleHead(head_cfg()).eval()


def drafting_pair(kind, target, random_head):
    """(target, head): "random" accepts next to nothing; "noisy" is the oracle head of a bigram target with its
    token pass-through perturbed, so it is right often but not always (accept lengths vary up to the bound)."""
    if kind == "random":
        return target, random_head
    bigram, head = _bigram_target_and_oracle_head()
    with torch.no_grad():
        noise = torch.randn(H, H, generator=torch.Generator().manual_seed(13))
        head.fc.weight[:, :H] += 1e6 * NOISY_HEAD_NOISE * noise
    return bigram, head


# Relative size of the noisy head's pass-through perturbation: at 0.02 every shape below both reaches its bound and
# stops early (at 0.01 the 30-node tree never stops early; at 0.05 the 10-node tree never reaches its bound).
NOISY_HEAD_NOISE = 0.02


@pytest.mark.parametrize("kind", ["random", "noisy"])
@pytest.mark.parametrize("total_token,depth,top_k", [(10, 4, 3), (4, 1, 3), (6, 5, 1), (30, 3, 8)])
def test_generate_equals_target_greedy(target, prompt, target_greedy, random_head, kind, total_token, depth, top_k):
    target, head = drafting_pair(kind, target, random_head)
    if kind != "random":
        with torch.no_grad():
            target_greedy = target.generate(prompt, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)
    model = EaFsdModel(target, None, EagleDrafter(head, target), total_token=total_token, depth=depth, top_k=top_k)
    out = model.generate(prompt, max_new_tokens=NEW, eos_token_id=[], return_dict=True)
    assert target_greedy.shape == (1, PROMPT_LEN + NEW)
    assert torch.equal(out.sequences, target_greedy)
    assert out.new_tokens == NEW
    assert out.verify_steps == len(out.accept_lengths)
    # depth draft forwards after the root's give paths of up to depth + 1 draft tokens, and the tree holds
    # total_token - 1 of them
    longest = min(depth + 1, total_token - 1)
    assert all(0 <= a <= longest for a in out.accept_lengths), out.accept_lengths
    if kind == "noisy":  # the bound is reached, and steps also end early: the walk stops where the draft is wrong
        assert max(out.accept_lengths) == longest and min(out.accept_lengths) < longest, out.accept_lengths


def _bigram_target_and_oracle_head():
    """A target whose next token depends on the current token only (attention and MLP outputs zeroed, so its feature
    is norm(embed(x_t))), and a head that predicts it exactly: fc passes the token embedding through, its own
    attention/MLP outputs are zeroed, so lm_head(head) = c * lm_head(embed(x_{t+1})) ~ the target's logits at t+1
    (up to positive scales, which keep the argmax)."""
    target = make_target(seed=12, layers=2)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = EagleHead(head_cfg()).eval()
        head.fc.weight.zero_()
        # a large scale makes the draft distribution one-hot (the target's logits at init are ~1e-3 apart), so the
        # top-1 chain (log-probs 0) outranks every sibling in the global rerank
        head.fc.weight[:, :H] = 1e6 * torch.eye(H)
        head.fc.bias.zero_()
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    return target, head


@pytest.mark.parametrize("total_token,depth,top_k", [(10, 4, 3), (6, 5, 1), (4, 1, 2)])
def test_generate_accepts_with_a_perfect_head(prompt, total_token, depth, top_k):
    target, head = _bigram_target_and_oracle_head()
    with torch.no_grad():
        ref = target.generate(prompt, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)
    model = EaFsdModel(target, None, EagleDrafter(head, target), total_token=total_token, depth=depth, top_k=top_k)
    out = model.generate(prompt, max_new_tokens=NEW, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, ref)
    # the top-1 chain is always right and always in the tree, so every step but the last (cut at NEW tokens)
    # accepts all of it
    full = min(depth + 1, total_token - 1)  # depth draft forwards after the root's: paths of up to depth + 1
    assert all(a == full for a in out.accept_lengths[:-1]), out.accept_lengths
    assert out.verify_steps < NEW


# ----------------------------------------------------------------------------- 5. Qwen2-style qkv_bias head
def test_qkv_bias_head_loads_and_matches(tmp_path, target):
    eagle_model = make_eagle(qkv_bias=True, embed=target.get_input_embeddings().weight)
    state = eagle_model.state_dict()
    assert "layers.0.self_attn.q_proj.bias" in state and "layers.0.self_attn.o_proj.bias" not in state
    path = write_head(tmp_path / "head", state, published_config(qkv_bias=True), "safetensors")
    head = load_eagle_head(path, target)
    attn = head.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(attn, name).bias, state[f"layers.0.self_attn.{name}.bias"])
    assert attn.o_proj.bias is None
    torch.manual_seed(13)
    ids = torch.randint(0, V, (1, 8))
    feats = torch.randn(1, 8, H)
    with torch.no_grad():
        ref = eagle_model(feats, ids)
        out = head(target.get_input_embeddings()(ids), feats, torch.arange(8)[None], causal_mask(0, 8, "cpu"))
    assert (out - ref).abs().max() <= TOL


def test_qkv_bias_flag_must_match_weights(tmp_path, target):
    biased = our_published_state(target, qkv_bias=True)
    path = write_head(tmp_path / "a", biased, published_config())  # config lacks qkv_bias
    with pytest.raises(ValueError, match=r"unexpected \[.*q_proj\.bias"):
        load_eagle_head(path, target)
    plain = our_published_state(target, qkv_bias=False)
    path = write_head(tmp_path / "b", plain, published_config(qkv_bias=True))
    with pytest.raises(ValueError, match=r"missing \[.*q_proj\.bias"):
        load_eagle_head(path, target)


# ----------------------------------------------------------------------------- the loader's head-kind detector
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_a_drafter_directory_holding_a_head_is_loaded_as_one(tmp_path, target, fmt):
    """--drafter DIR / draft_model=DIR: a directory whose weights hold EAGLE's fc is a head (config.json then says
    which kind); an LM directory, a hub id or a loaded model stays an LM; a head named as one is read by config."""
    from eagle_fsd.loading import build_drafter, drafter_source

    head_dir = str(write_head(tmp_path / "head", our_published_state(target), published_config(), fmt=fmt))
    assert drafter_source("not-a-preset", None, head_dir) == ("eagle", head_dir)
    assert drafter_source("not-a-preset", head_dir, None) == ("eagle", head_dir)
    lm_dir = tmp_path / "lm"
    lm_dir.mkdir()
    assert drafter_source("not-a-preset", None, str(lm_dir)) == ("lm", str(lm_dir))
    assert drafter_source("not-a-preset", None, "some-org/some-lm") == ("lm", "some-org/some-lm")
    assert drafter_source("not-a-preset", None, None) == (None, None)
    assert isinstance(build_drafter("eagle", head_dir, target, None), EagleDrafter)


def test_requested_tree_fills_unset_values_and_checks_before_loading():
    from eagle_fsd.loading import requested_tree

    assert requested_tree(True, (None, 3, None)) == ({"depth": 3}, ["total_token", "branching", "draft_vocab"])
    assert requested_tree(False, (None, None, 4)) == (
        {"total_token": 60, "depth": 5, "branching": 4, "draft_vocab": 0}, [])  # a fixed tree drafts over all tokens
    assert requested_tree(True, (5, 1, 4, 37888)) == (  # all four given: the tree is pinned, nothing is tuned
        {"total_token": 5, "depth": 1, "branching": 4, "draft_vocab": 37888}, [])
    assert requested_tree(True, (5, 1, 4, "auto")) == ({"total_token": 5, "depth": 1, "branching": 4}, ["draft_vocab"])
    with pytest.raises(ValueError, match="branching"):
        requested_tree(False, (8, 3, 0))
    with pytest.raises(ValueError, match="draft_vocab"):
        requested_tree(False, (8, 3, 2, -1))
