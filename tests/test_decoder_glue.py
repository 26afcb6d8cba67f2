"""The fused decoder steps (eagle_fsd.kernels.decoder_glue) against float64 references on fresh random inputs, rows
independent of their call; the LM drafter's fused forward (eagle_fsd.fused_decoder) against transformers' forward of
the same tiny Llama and Qwen2 models, branch by branch of a tree. Needs a C++ compiler: elsewhere these tests are
reported as skipped."""
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eagle_fsd.attention import ForwardState
from eagle_fsd.cache import TreeCache
from eagle_fsd.drafting import LMDrafter
from eagle_fsd.fused_decoder import fused_decoder_forward, fused_fits, linears
from eagle_fsd.hf import causal_mask, decoder_forward, prefix_tree_mask
from eagle_fsd.kernels import decoder_glue as glue
from eagle_fsd.loading import model_run, plan_for
from eagle_fsd.plan import WeightFormat
from eagle_fsd.weights import PREPACKED, format_weights
from tiny import tiny_model

pytestmark = pytest.mark.skipif(not glue.decoder_glue_available(), reason="needs a C++ compiler and ninja")

ROWS_TARGET = WeightFormat("rows", four_bit=True, requantize=True)  # an exact int4 x int8 target
ROWS_DRAFTER = WeightFormat("rows", exact=False, four_bit=True, requantize=True)  # the drafter beside it


def target_run(model, fmt=WeightFormat()):
    """How the loader's plan runs `model` as a target with weights in `fmt` (the fused forward where it fits)."""
    return model_run(model, fmt, "auto", exact=True, decoder=True)


def strided_rows(rows, width, generator):
    """(rows, width) fp32 whose rows sit apart in memory: a column slice, as a shared product's output is."""
    return (torch.randn(rows, width + 24, generator=generator) * 3)[:, 8:8 + width]


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_rms_norm_matches_float64(rows):
    g = torch.Generator().manual_seed(rows)
    x, w = strided_rows(rows, 96, g), torch.randn(96, generator=g)
    x[0, 7] = 300.0  # an outlier channel
    y = glue.rms_norm(x, w, 1e-6)
    want = glue.rms_norm_reference(x, w, 1e-6)
    assert y.shape == (rows, 96) and y.dtype == torch.float32
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, heads", [(1, 4), (5, 2)])
def test_rope_matches_float64_and_transformers(rows, heads):
    g = torch.Generator().manual_seed(10 * rows + heads)
    dim = 16
    x = strided_rows(rows, heads * dim, g)
    angles = torch.rand(rows, dim // 2, generator=g) * 50
    angles = torch.cat([angles, angles], 1)
    cos, sin = angles.cos(), angles.sin()
    y = glue.rope(x, cos, sin, heads)
    assert y.shape == (1, heads, rows, dim)
    assert torch.allclose(y.double(), glue.rope_reference(x, cos, sin, heads), rtol=1e-6, atol=1e-6)
    as_heads = x.reshape(1, rows, heads, dim).transpose(1, 2)
    theirs, _ = apply_rotary_pos_emb(as_heads, as_heads, cos[None], sin[None])
    assert torch.equal(y, theirs)  # the same two products and one sum per value, rounded alike


def test_silu_mul_matches_float64():
    g = torch.Generator().manual_seed(3)
    both = strided_rows(4, 80, g)
    gate, up = both[:, :40], both[:, 40:]
    assert torch.allclose(glue.silu_mul(gate, up).double(), glue.silu_mul_reference(gate, up), rtol=1e-5,
                          atol=1e-6)


def test_each_row_is_independent_of_its_call():
    g = torch.Generator().manual_seed(4)
    x, w = strided_rows(9, 64, g), torch.randn(64, generator=g)
    cos, sin = torch.rand(9, 16, generator=g), torch.rand(9, 16, generator=g)
    norms = torch.cat([glue.rms_norm(x[i:i + 1], w, 1e-5) for i in range(9)])
    assert torch.equal(glue.rms_norm(x, w, 1e-5), norms)
    ropes = torch.cat([glue.rope(x[i:i + 1], cos[i:i + 1], sin[i:i + 1], 4) for i in range(9)], 2)
    assert torch.equal(glue.rope(x, cos, sin, 4), ropes)
    many = strided_rows(150, 64, g)  # past one task's rows: split over threads
    alone = torch.cat([glue.rms_norm(many[i:i + 1], w, 1e-5) for i in range(150)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(glue.rms_norm(many, w, 1e-5), alone)
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_name_what_was_expected():
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="rms_norm weight: expected 64"):
        glue.rms_norm(x, torch.randn(63), 1e-6)
    with pytest.raises(RuntimeError, match="is not 3 heads"):
        glue.rope(x, torch.rand(3, 16), torch.rand(3, 16), 3)
    with pytest.raises(RuntimeError, match="expected a 2-D fp32"):
        glue.rms_norm(x.double(), torch.randn(64), 1e-6)


def random_tree(n, generator):
    """(n, n) ancestor-or-self mask of a random tree whose parents come before their children, and its depths."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]
    tree = torch.eye(n, dtype=torch.bool)
    for node, parent in enumerate(parents):
        while parent >= 0:
            tree[node, parent], parent = True, parents[parent]
    return tree, tree.sum(1) - 1


def prefixed(tree, start):
    """(n, start + n): every earlier slot visible, then the tree among this call's rows."""
    return torch.cat([torch.ones(tree.shape[0], start, dtype=torch.bool), tree], 1)


def attend_inputs(generator, n, start, heads=4, kv_heads=2, dim=16, dtype=torch.float32, max_len=40):
    qkv = strided_rows(n, (heads + 2 * kv_heads) * dim, generator)
    angles = torch.rand(n, dim // 2, generator=generator) * 50
    angles = torch.cat([angles, angles], 1)
    keys = torch.randn(1, kv_heads, max_len, dim, generator=generator).to(dtype)
    values = torch.randn(1, kv_heads, max_len, dim, generator=generator).to(dtype)
    return qkv, angles.cos(), angles.sin(), keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, start", [(1, 7), (6, 11), (9, 0)])
def test_attend_matches_float64(dtype, n, start):
    g = torch.Generator().manual_seed(100 * n + start)
    qkv, cos, sin, keys, values = attend_inputs(g, n, start, dtype=dtype)
    tree, _ = random_tree(n, g)
    earlier = torch.rand(n, start, generator=g) < 0.7  # a draft level sees some earlier slots (its ancestors) only
    mask = torch.cat([earlier, tree], 1)
    want, want_keys, want_values = glue.attend_reference(qkv, cos, sin, keys, values, start, mask, 4, 2, 0.25)
    out = glue.attend(qkv, cos, sin, keys, values, start, mask, 4, 2, 0.25)
    assert out.shape == (n, 64) and out.dtype == torch.float32
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(keys.double(), want_keys.double(), rtol=1e-6, atol=1e-6)  # roped keys stored in place
    assert torch.equal(values, want_values)
    assert torch.equal(keys[:, :, start + n:], want_keys[:, :, start + n:])  # nothing past the rows written


@pytest.mark.parametrize("dim", [8, 48, 96, 128, 256])
def test_attend_matches_float64_at_every_head_width(dim):
    """Head widths through each piece of the vector loops (vectors of 16 floats, in pieces of 8, 4, 2 and 1; 8: the
    scalar loops), slot counts that leave the last vector part empty, and scores spread past e^-87, where the
    exponential gives 0."""
    g = torch.Generator().manual_seed(dim)
    n, start = 3, 37
    qkv, cos, sin, keys, values = attend_inputs(g, n, start, heads=6, kv_heads=2, dim=dim, max_len=48)
    mask = prefixed(random_tree(n, g)[0], start)
    for scale in (dim ** -0.5, 40.0):
        want, _, _ = glue.attend_reference(qkv, cos, sin, keys, values, start, mask, 6, 2, scale)
        out = glue.attend(qkv, cos, sin, keys.clone(), values.clone(), start, mask, 6, 2, scale)
        assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5), scale


@pytest.mark.parametrize("dim", [32, 128])
def test_attend_gives_a_tree_node_the_bits_of_its_branch_as_a_chain(dim):
    """Each node of a tree attended in one call equals the same node attended alone on top of a cache holding the
    prefix and its ancestors only (a plain decoding step after the branch was accepted): the same bits."""
    g = torch.Generator().manual_seed(5)
    n, start = 7, 9
    qkv, cos, sin, keys, values = attend_inputs(g, n, start, heads=6, kv_heads=2, dim=dim)
    tree, depths = random_tree(n, g)
    tree_keys, tree_values = keys.clone(), values.clone()
    out = glue.attend(qkv, cos, sin, tree_keys, tree_values, start, prefixed(tree, start), 6, 2, 0.125)
    for node in range(n):
        branch = tree[node].nonzero()[:, 0]  # its ancestors and itself, root first
        chain_keys, chain_values = keys.clone(), values.clone()
        chain_keys[:, :, start:start + branch.numel()] = tree_keys[:, :, start + branch]
        chain_values[:, :, start:start + branch.numel()] = tree_values[:, :, start + branch]
        at = start + int(depths[node])
        alone = glue.attend(qkv[node:node + 1], cos[node:node + 1], sin[node:node + 1], chain_keys, chain_values, at,
                            torch.ones(1, at + 1, dtype=torch.bool), 6, 2, 0.125)
        assert torch.equal(alone[0], out[node]), node


def test_attend_is_independent_of_threads():
    g = torch.Generator().manual_seed(6)
    qkv, cos, sin, keys, values = attend_inputs(g, 12, 30, heads=8, kv_heads=2, dim=64, max_len=64)
    tree, _ = random_tree(12, g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = glue.attend(qkv, cos, sin, keys.clone(), values.clone(), 30, prefixed(tree, 30), 8, 2, 0.125)
        torch.set_num_threads(2)
        two = glue.attend(qkv, cos, sin, keys.clone(), values.clone(), 30, prefixed(tree, 30), 8, 2, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("k", [1, 3, 10])
@pytest.mark.parametrize("width", [12, 100, 1003])
def test_top_logprobs_match_torchs_topk_and_logsumexp(k, width):
    """Widths below one vector of 16, and with a partial last one; several rows at once."""
    g = torch.Generator().manual_seed(width + k)
    logits = (torch.randn(3, width, generator=g, dtype=torch.float64) * 4).float().double()
    logprobs, columns = glue.top_logprobs(logits.float(), k)
    want = logits.topk(k, -1)
    assert torch.equal(columns, want.indices)
    want_logprobs = want.values - torch.logsumexp(logits, -1, keepdim=True)
    assert torch.allclose(logprobs.double(), want_logprobs, rtol=0, atol=2e-6)


def test_top_logprobs_put_equal_logits_in_column_order():
    logits = torch.zeros(1, 50)
    logits[0, [3, 17, 40]] = 2.0  # in the first pass, in a later vector, in a vector after that
    logits[0, 45] = 1.0
    assert glue.top_logprobs(logits, 4)[1].tolist() == [[3, 17, 40, 45]]
    assert glue.top_logprobs(logits[:, 4:].contiguous(), 1)[1].tolist() == [[13]]
    with pytest.raises(RuntimeError, match="k = 51 must lie in \\[1, 50\\]"):
        glue.top_logprobs(logits, 51)


def test_attend_bad_inputs_name_what_was_expected():
    g = torch.Generator().manual_seed(7)
    qkv, cos, sin, keys, values = attend_inputs(g, 3, 5)
    mask = prefixed(torch.ones(3, 3, dtype=torch.bool).tril(), 5)
    with pytest.raises(RuntimeError, match="is not q | k | v of 3 \\+ 2 x 2 heads"):
        glue.attend(qkv, cos, sin, keys, values, 5, mask, 3, 2, 0.25)
    with pytest.raises(RuntimeError, match="overflow the cache of 40"):
        glue.attend(qkv, cos, sin, keys, values, 38, prefixed(mask[:, 5:], 38), 4, 2, 0.25)
    with pytest.raises(RuntimeError, match="must be fp32 or fp64"):
        glue.attend(qkv, cos, sin, keys.half(), values.half(), 5, mask, 4, 2, 0.25)
    with pytest.raises(RuntimeError, match="contiguous \\(3, 8\\) bool mask"):
        glue.attend(qkv, cos, sin, keys, values, 5, mask.float(), 4, 2, 0.25)
    with pytest.raises(RuntimeError, match="contiguous \\(3, 8\\) bool mask"):
        glue.attend(qkv, cos, sin, keys, values, 5, mask[:, 5:].contiguous(), 4, 2, 0.25)


def test_rms_norm_like_transformers_is_their_module_to_the_bit():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    g = torch.Generator().manual_seed(8)
    module = Qwen2RMSNorm(96, eps=1e-6)
    module.weight.data = torch.randn(96, generator=g)
    x = torch.randn(5, 96, generator=g) * 4
    with torch.no_grad():
        assert torch.equal(glue.rms_norm_like_transformers(x, module.weight, 1e-6), module(x))


def tree_blocks(generator, start):
    """A tree of 5 nodes (root 0 with children 1 and 2; 3 under 1; 4 under 3) and a one-token step, on top of a
    prompt of `start` tokens: (tokens, ancestor-or-self mask, positions) each."""
    parents = [-1, 0, 0, 1, 3]
    tree = torch.eye(5, dtype=torch.bool)
    for node, parent in enumerate(parents):
        while parent >= 0:
            tree[node, parent], parent = True, parents[parent]
    depths = tree.sum(1) - 1
    return [(torch.randint(0, 1000, (5,), generator=generator), tree, start + depths),
            (torch.randint(0, 1000, (1,), generator=generator), torch.ones(1, 1, dtype=torch.bool),
             torch.tensor([start]))]


def forwards(model, forward, prompt, blocks, run):
    """Hidden states of `forward` (run as `run` says) over the prompt, then over each (tokens, tree mask, positions)
    block on top of it (each block scratch: cropped after)."""
    cache = TreeCache.for_model(model, 128, run)
    with torch.no_grad():
        outs = [forward(model, prompt, cache, causal_mask(0, prompt.numel(), prompt.device),
                        torch.arange(prompt.numel()), run)]
        for tokens, tree, positions in blocks:
            outs.append(forward(model, tokens, cache, prefix_tree_mask(prompt.numel(), tree), positions, run))
            cache.crop(prompt.numel())
    return outs


def transformers_forward(model, ids, cache, mask, positions, run):
    """transformers' own decoder forward (what eagle_fsd.hf ran before the fused one), attending in float64 where the
    run does (a row-exact target)."""
    decoder = model.get_decoder()
    out = decoder(input_ids=ids[None], attention_mask=mask, position_ids=positions[None], cache=cache,
                  use_cache=True, eagle_fsd_forward=ForwardState(run.backend, fp64=run.fp64_attention))
    return out.last_hidden_state[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["fp32", "prepacked"])
def test_exact_fused_forward_equals_transformers_to_the_bit(kind, weights):
    model = tiny_model(kind, seed=7)
    fmt = PREPACKED if weights == "prepacked" else WeightFormat()
    format_weights(model, fmt)
    run = target_run(model, fmt)
    assert fused_fits(model) and run.fused
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1000, (6,), generator=g)
    blocks = tree_blocks(g, 6)
    ours, theirs = (forwards(model, fused_decoder_forward, prompt, blocks, run),
                    forwards(model, transformers_forward, prompt, blocks, run))
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)
    assert all(torch.equal(a, b) for a, b in zip(forwards(model, decoder_forward, prompt, blocks, run), ours))


def branch_chains(model, forward, prompt, tree_block, run):
    """Hidden states of each branch of the tree block (tokens, tree, positions) run as a chain on top of the prompt:
    node -> its state at the end of its branch."""
    tokens, tree, positions = tree_block
    states = {}
    for node in range(tokens.numel()):
        branch = tree[node].nonzero()[:, 0]
        chain = (tokens[branch], torch.ones(branch.numel(), branch.numel(), dtype=torch.bool).tril(),
                 positions[branch])
        states[node] = forwards(model, forward, prompt, [chain], run)[1][-1]
    return states


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_quantized_target_tree_nodes_equal_their_branches_to_the_bit(kind):
    """An exact int4 x int8 target (8-bit rows magnify any last-bit difference): every tree node's hidden state
    equals the one its branch gets decoded as a chain, to the bit, and stays close to transformers' forward (which
    attends in float64 and sums its norms in another order)."""
    model = tiny_model(kind, seed=7)
    format_weights(model, ROWS_TARGET)
    run = target_run(model, ROWS_TARGET)
    assert fused_fits(model) and run.fused and run.fp64_attention and run.rows_attend
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1000, (6,), generator=g)
    blocks = tree_blocks(g, 6)
    ours = forwards(model, fused_decoder_forward, prompt, blocks, run)
    for node, state in branch_chains(model, fused_decoder_forward, prompt, blocks[0], run).items():
        assert torch.equal(state, ours[1][node]), node
    theirs = forwards(model, transformers_forward, prompt, blocks, run)
    for mine, reference in zip(ours, theirs):
        assert torch.allclose(mine, reference, rtol=5e-2, atol=5e-2)
    assert all(torch.equal(a, b) for a, b in zip(forwards(model, decoder_forward, prompt, blocks, run), ours))


@pytest.mark.parametrize("quantized", [False, True])
def test_fused_features_are_the_hidden_states_entering_the_layers(quantized):
    """EAGLE-3 features from the fused forward: what transformers' decoder reports as hidden_states[i] (a float
    target: to the bit; a quantized one: close), the final-norm state for i = number of layers."""
    from eagle_fsd.hf import decoder_outputs

    model = tiny_model("qwen2", seed=9)
    fmt = ROWS_TARGET if quantized else WeightFormat()
    format_weights(model, fmt)
    run = target_run(model, fmt)
    assert run.fused
    layers = (0, 1, model.config.num_hidden_layers)
    ids = torch.randint(0, 1000, (5,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        last, features = decoder_outputs(model, ids, TreeCache.for_model(model, 16, run), causal_mask(0, 5, "cpu"),
                                         torch.arange(5), run, feature_layers=layers)
        out = model.get_decoder()(input_ids=ids[None], attention_mask=causal_mask(0, 5, "cpu"),
                                  position_ids=torch.arange(5)[None], cache=TreeCache.for_model(model, 16, run),
                                  use_cache=True, output_hidden_states=True,
                                  eagle_fsd_forward=ForwardState(run.backend, fp64=run.fp64_attention))
    want = torch.cat([out.hidden_states[i][0] for i in layers], -1)
    if quantized:  # its norms are summed in another order: close, not the same bits
        assert torch.allclose(last, out.last_hidden_state[0], rtol=5e-2, atol=5e-2)
        assert torch.allclose(features, want, rtol=5e-2, atol=5e-2)
    else:
        assert torch.equal(last, out.last_hidden_state[0]) and torch.equal(features, want)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("quantized", [False, True])
def test_drafter_forward_matches_transformers_branch_by_branch(kind, quantized):
    model = tiny_model(kind, seed=7)
    fmt = ROWS_DRAFTER if quantized else WeightFormat()  # the drafter as the engine runs it beside a quantized target
    format_weights(model, fmt)
    run = model_run(model, fmt, "auto", exact=False, decoder=True)  # the loader's plan for a drafter
    assert run.fused and not run.exact and run.rows_attend and not run.fp64_attention
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1000, (6,), generator=g)
    blocks = tree_blocks(g, 6)
    ours, theirs = (forwards(model, fused_decoder_forward, prompt, blocks, run),
                    forwards(model, transformers_forward, prompt, blocks, run))
    tolerance = 5e-2 if quantized else 1e-4  # 8-bit activations turn last-bit differences into rounding steps
    for mine, reference in zip(ours, theirs):
        assert torch.allclose(mine, reference, rtol=tolerance, atol=tolerance)
    # branch 0-1-3-4 of the tree as a chain: what the tree gives those nodes
    tokens = blocks[0][0][[0, 1, 3, 4]]
    chain = forwards(model, fused_decoder_forward, prompt, [(tokens, torch.ones(4, 4, dtype=torch.bool).tril(),
                                                             torch.arange(6, 10))], run)[1]
    assert torch.allclose(chain, ours[1][[0, 1, 3, 4]], rtol=1e-5, atol=1e-5)


def test_unsupported_models_keep_the_transformers_forward():
    for model in (tiny_model("llama", hidden_act="gelu"),
                  tiny_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0),
                  tiny_model("llama").to(torch.bfloat16)):
        assert not fused_fits(model) and not target_run(model).fused


def test_the_lm_drafter_runs_the_fused_forward_with_its_own_norms(monkeypatch):
    import eagle_fsd.hf as hf

    model = tiny_model("llama", seed=3)
    drafter = LMDrafter(model, 1000)
    drafter.run = plan_for(model, drafter).drafter  # the loader's plan for it (EaFsdModel sets it so)
    assert drafter.run.fused and not drafter.run.exact
    calls = []

    def counted(*args, **kwargs):
        run = args[5] if len(args) > 5 else kwargs["run"]
        calls.append(run.exact)
        return fused_decoder_forward(*args, **kwargs)

    monkeypatch.setattr(hf, "fused_decoder_forward", counted)
    drafter.cache = TreeCache.for_model(model, 128, drafter.run)
    with torch.no_grad():
        hidden, _ = drafter._hidden(torch.tensor([5, 6]), None, causal_mask(0, 2, "cpu"), torch.arange(2))
    assert calls == [False] and hidden.shape == (2, 64)


def swap_linears_of(layer, modules):
    """Sets the layer's q, k, v, gate, up, o, down modules (eagle_fsd.fused_decoder.linears order) to `modules`."""
    attention, mlp = layer.self_attn, layer.mlp
    for (parent, name), module in zip(((attention, "q_proj"), (attention, "k_proj"), (attention, "v_proj"),
                                       (mlp, "gate_proj"), (mlp, "up_proj"), (attention, "o_proj"),
                                       (mlp, "down_proj")), modules):
        setattr(parent, name, module)


def test_layer_plans_call_shared_products_once_and_follow_module_swaps():
    from eagle_fsd.fused_decoder import layer_plan

    model = tiny_model("qwen2", seed=7)
    layer = model.get_decoder().layers[0]
    floats = linears(layer)  # the float weights as loaded
    format_weights(model, ROWS_TARGET)
    quantized = linears(layer)
    plan = layer_plan(layer)
    assert plan.qkv is layer.self_attn.q_proj.product.product and plan.gate_up is layer.mlp.up_proj.product.product
    assert plan.o is layer.self_attn.o_proj.product
    swap_linears_of(layer, floats)  # the float layers through F.linear: every layer called as a module
    plan = layer_plan(layer)
    assert plan.qkv is None and plan.gate_up is None and plan.o is layer.self_attn.o_proj
    swap_linears_of(layer, quantized)
    assert layer_plan(layer).o is layer.self_attn.o_proj.product


def test_the_rows_plan_follows_a_layer_swap_and_rereads_no_layer_otherwise(monkeypatch):
    """A one-call plan is checked against the decoder's layers again only after a module was assigned somewhere: a
    layer swapped for a float one after the plan was built sends the forward layer by layer; no swap, no layer read."""
    import eagle_fsd.fused_decoder as fused
    from eagle_fsd.kernels.int4_rows import int4_rows_available

    if not int4_rows_available():
        pytest.skip("no int4_rows build on this CPU: no one-call plan to follow")
    model = tiny_model("qwen2", seed=7)
    layer = model.get_decoder().layers[1]
    floats = linears(layer)
    format_weights(model, ROWS_TARGET)
    plan = fused.rows_plan(model.get_decoder())
    assert plan.calls is not None
    read = []
    monkeypatch.setattr(fused, "layer_plan", lambda layer: read.append(layer) or fused._plans[layer])
    assert fused.rows_plan(model.get_decoder()) is plan and read == []
    monkeypatch.undo()
    swap_linears_of(layer, floats)
    assert fused.rows_plan(model.get_decoder()).calls is None


def gguf_like(model):
    """Q4_K_M's mix in a tiny model: q, k, o, gate and up rounded to 4 bits (int4 kernel), v and down left as they
    are (int8: int8_rows where this CPU runs it)."""
    from eagle_fsd.kernels.int4_rows import dequantize_int4, quantize_int4

    with torch.no_grad():
        for layer in model.get_decoder().layers:
            for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.o_proj, layer.mlp.gate_proj,
                      layer.mlp.up_proj):
                m.weight.copy_(dequantize_int4(*quantize_int4(m.weight)).float())


def steps_on_a_prompt(model, run):
    """Hidden states and the first layer's cache after: a 5-node tree (scratch), then two plain steps in a row."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1000, (6,), generator=g)
    tree_block, _ = tree_blocks(g, 6)
    cache = TreeCache.for_model(model, 64, run)
    outs = []
    with torch.no_grad():
        fused_decoder_forward(model, prompt, cache, causal_mask(0, 6, "cpu"), torch.arange(6), run)
        tokens, tree, positions = tree_block
        outs.append(fused_decoder_forward(model, tokens, cache, prefix_tree_mask(6, tree), positions, run))
        cache.crop(6)
        for step in range(2):  # the second step attends to the first: the cache's length moved on
            outs.append(fused_decoder_forward(model, tokens[step:step + 1], cache, causal_mask(6 + step, 1, "cpu"),
                                              torch.tensor([6 + step]), run))
        storage = cache.layers[0]
        outs += [storage.keys[:, :, :storage.length].clone(), storage.values[:, :, :storage.length].clone()]
    return outs


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("mix", ["int4", "gguf", "drafter"])
def test_one_call_forward_equals_layer_by_layer_to_the_bit(kind, mix, monkeypatch):
    """rows_forward (the whole forward in one C++ call) against the same steps layer by layer from Python: the same
    bits for every tree node, plain step and cache entry; int4 only, Q4_K_M's int4/int8 mix (one call where the int8
    layers run int8_rows: a build of it takes this CPU's activation bits), and a drafter (all int4, not exact)."""
    from eagle_fsd.fused_decoder import layer_by_layer, rows_plan
    from eagle_fsd.kernels.int4_rows import int4_rows_available
    from eagle_fsd.kernels.int8_rows import int8_rows_available
    from eagle_fsd.target_quant import cpu_activation_bits

    if not int4_rows_available():
        pytest.skip("the one-call forward runs own kernels only; this CPU has no int4 build")
    import eagle_fsd.fused_decoder as fused

    model = tiny_model(kind, seed=7)
    with torch.no_grad():  # norms of their own (a fresh model's are all ones)
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 1.5)
    if mix == "gguf":
        gguf_like(model)
    exact = mix != "drafter"
    fmt = WeightFormat("rows", exact=exact, four_bit=True, requantize=mix != "gguf")
    format_weights(model, fmt)
    run = model_run(model, fmt, "auto", exact=exact, decoder=True)
    assert run.fused and run.rows_attend
    one_call = rows_plan(model.get_decoder()).calls is not None
    assert one_call == (mix != "gguf" or int8_rows_available(cpu_activation_bits()))
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return glue.rows_forward(*args)

    monkeypatch.setattr(fused, "rows_forward", counted)
    ours = steps_on_a_prompt(model, run)
    assert calls == ([5, 1, 1] if one_call else [])  # the prompt goes to SDPA
    with layer_by_layer():
        reference = steps_on_a_prompt(model, run)
    assert len(calls) == (3 if one_call else 0)
    for mine, theirs in zip(ours, reference):
        assert torch.equal(mine, theirs)
    assert ours[-1].shape[2] == 8  # prompt and two steps


def test_one_call_forward_falls_back_and_checks_the_cache():
    """A product the C++ loop cannot call (FBGEMM's, for a drafter's int8 layers) keeps the layer-by-layer forward;
    a forward past the preallocated cache is refused by name."""
    from eagle_fsd.fused_decoder import rows_plan
    from eagle_fsd.kernels.int4_rows import int4_rows_available

    model = tiny_model("qwen2", seed=7)
    format_weights(model, WeightFormat("rows", exact=False))  # int8, one rounding scale per call: FBGEMM
    assert rows_plan(model.get_decoder()).calls is None
    if not int4_rows_available():
        return
    model = tiny_model("qwen2", seed=7)
    format_weights(model, ROWS_TARGET)
    assert rows_plan(model.get_decoder()).calls is not None
    run = target_run(model, ROWS_TARGET)
    cache = TreeCache.for_model(model, 8, run)
    with torch.no_grad():
        fused_decoder_forward(model, torch.arange(6), cache, causal_mask(0, 6, "cpu"), torch.arange(6), run)
        with pytest.raises(RuntimeError, match="KV cache overflow: 9 tokens > preallocated 8"):
            fused_decoder_forward(model, torch.arange(3), cache, causal_mask(6, 3, "cpu"), torch.arange(6, 9), run)


def test_products_are_placed_only_where_their_columns_fall_in_module_order():
    from eagle_fsd.fused_decoder import placed_products
    from eagle_fsd.kernels.int4_rows import int4_rows_available

    if not int4_rows_available():
        pytest.skip("places own kernel products only; this CPU has no int4 build")
    model = tiny_model("qwen2", seed=7)
    format_weights(model, ROWS_TARGET)
    attention = model.get_decoder().layers[0].self_attn
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    assert placed_products([q, k, v]) == [(q.product.product, 0)]
    assert placed_products([q, v, k]) is None  # the shared product writes q | k | v
    assert placed_products([q, k]) is None  # it would write v's columns too
    assert placed_products([attention.o_proj]) == [(attention.o_proj.product, 0)]
