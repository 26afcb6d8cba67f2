"""The fused decoder steps (eagle_fsd.kernels.decoder_glue) against float64 references on fresh random inputs, rows
independent of their call; the LM drafter's fused forward (eagle_fsd.fused_decoder) against transformers' forward of
the same tiny Llama and Qwen2 models, branch by branch of a tree. Needs a C++ compiler: elsewhere these tests are
reported as skipped."""
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eagle_fsd.cache import TreeCache
from eagle_fsd.drafters import LMDrafter
from eagle_fsd.fused_decoder import fused_decoder_forward, runs_fused
from eagle_fsd.hf import causal_mask, decoder_forward, prefix_tree_mask
from eagle_fsd.prepack import prepack_linears
from eagle_fsd.kernels import decoder_glue as glue
from eagle_fsd.target_quant import quantize_target
from tiny import tiny_model

pytestmark = pytest.mark.skipif(not glue.decoder_glue_available(), reason="needs a C++ compiler and ninja")


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


def forwards(model, forward, prompt, blocks):
    """Hidden states of `forward` over the prompt, then over each (tokens, tree mask, positions) block on top of it
    (each block scratch: cropped after)."""
    cache = TreeCache.for_model(model, 128)
    with torch.no_grad():
        outs = [forward(model, prompt, cache, causal_mask(0, prompt.numel(), prompt.device),
                        torch.arange(prompt.numel()))]
        for tokens, tree, positions in blocks:
            outs.append(forward(model, tokens, cache, prefix_tree_mask(prompt.numel(), tree), positions))
            cache.crop(prompt.numel())
    return outs


def transformers_forward(model, ids, cache, mask, positions):
    """transformers' own decoder forward (what eagle_fsd.hf ran before the fused one)."""
    decoder = model.get_decoder()
    out = decoder(input_ids=ids[None], attention_mask=mask, position_ids=positions[None], cache=cache,
                  use_cache=True)
    return out.last_hidden_state[0]


def drafter_forward(model, ids, cache, mask, positions):
    return fused_decoder_forward(model, ids, cache, mask, positions, exact=False)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["fp32", "prepacked", "int4 x int8"])
def test_exact_fused_forward_equals_transformers_to_the_bit(kind, weights):
    model = tiny_model(kind, seed=7)
    if weights == "prepacked":
        prepack_linears(model)
    elif weights == "int4 x int8":  # an exact quantized target: 8-bit rows magnify any last-bit difference
        quantize_target(model, four_bit=True, requantize=True)
    assert runs_fused(model)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1000, (6,), generator=g)
    blocks = tree_blocks(g, 6)
    ours, theirs = forwards(model, fused_decoder_forward, prompt, blocks), forwards(model, transformers_forward,
                                                                                    prompt, blocks)
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)
    assert all(torch.equal(a, b) for a, b in zip(forwards(model, decoder_forward, prompt, blocks), ours))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("quantized", [False, True])
def test_drafter_forward_matches_transformers_branch_by_branch(kind, quantized):
    model = tiny_model(kind, seed=7)
    if quantized:  # the drafter as the engine runs it beside a quantized target
        quantize_target(model, exact=False, four_bit=True, requantize=True)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1000, (6,), generator=g)
    blocks = tree_blocks(g, 6)
    ours, theirs = forwards(model, drafter_forward, prompt, blocks), forwards(model, transformers_forward,
                                                                              prompt, blocks)
    tolerance = 5e-2 if quantized else 1e-4  # 8-bit activations turn last-bit differences into rounding steps
    for mine, reference in zip(ours, theirs):
        assert torch.allclose(mine, reference, rtol=tolerance, atol=tolerance)
    # branch 0-1-3-4 of the tree as a chain: what the tree gives those nodes
    tokens = blocks[0][0][[0, 1, 3, 4]]
    chain = forwards(model, drafter_forward, prompt, [(tokens, torch.ones(4, 4, dtype=torch.bool).tril(),
                                                       torch.arange(6, 10))])[1]
    assert torch.allclose(chain, ours[1][[0, 1, 3, 4]], rtol=1e-5, atol=1e-5)


def test_unsupported_models_keep_the_transformers_forward():
    assert not runs_fused(tiny_model("llama", hidden_act="gelu"))
    assert not runs_fused(tiny_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert not runs_fused(tiny_model("llama").to(torch.bfloat16))


def test_the_lm_drafter_runs_the_fused_forward_with_its_own_norms(monkeypatch):
    import eagle_fsd.drafters as drafters

    model = tiny_model("llama", seed=3)
    drafter = LMDrafter(model, 1000)
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("exact"))
        return fused_decoder_forward(*args, **kwargs)

    monkeypatch.setattr(drafters, "fused_decoder_forward", counted)
    drafter.cache = TreeCache.for_model(model, 128)
    with torch.no_grad():
        hidden, _ = drafter._hidden(torch.tensor([5, 6]), None, causal_mask(0, 2, "cpu"), torch.arange(2))
    assert calls == [False] and hidden.shape == (2, 64)
