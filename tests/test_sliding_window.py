"""Sliding-window attention (Mistral, Qwen2 with use_sliding_window, mixed `layer_types`): the engine's explicit masks
must be cut to each layer's window, in the target and in an LM drafter, or greedy output silently differs from the
target's own (transformers passes explicit 4-D masks through unchanged)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

import eagle_fsd.attention as attention
from eagle_fsd.cache import TreeCache
from eagle_fsd.drafting import EagleDrafter, EagleHead, LMDrafter
from eagle_fsd.hf import causal_mask, decoder_forward, prefix_tree_mask
from eagle_fsd.loading import plan_for
from eagle_fsd.model import EaFsdModel
from eagle_fsd.plan import ModelRun
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tree.accept import top_child
from eagle_fsd.tree.dynamic import ancestor_table, tree_mask_from_ancestors
from tiny import SIZES, hf_greedy, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 200
LAYERS = 3


def sliding_model(kind: str, window: int, seed: int = 1):
    """A tiny causal LM whose layers slide with `window`:
    mistral   -- MistralConfig.sliding_window (every layer);
    qwen2     -- use_sliding_window with max_window_layers=0 (every layer);
    mixed     -- Qwen2 with layer_types full / sliding / sliding;
    mixed_sf  -- Qwen2 with layer_types sliding / full / sliding."""
    sizes = {**SIZES, "num_hidden_layers": LAYERS}
    if kind == "mistral":
        torch.manual_seed(seed)
        config = MistralConfig(vocab_size=VOCAB, attn_implementation="eagle_fsd", sliding_window=window, **sizes)
        return AutoModelForCausalLM.from_config(config).eval()
    types = {"qwen2": None,
             "mixed": ["full_attention", "sliding_attention", "sliding_attention"],
             "mixed_sf": ["sliding_attention", "full_attention", "sliding_attention"]}[kind]
    extra = dict(max_window_layers=0) if types is None else dict(layer_types=types)
    return tiny_model("qwen2", vocab=VOCAB, seed=seed, num_hidden_layers=LAYERS, use_sliding_window=True,
                      sliding_window=window, **extra)


def reference_greedy(model, ids, n):
    """transformers' own greedy decoding with its own SDPA attention and its own sliding-window masks and caches."""
    model.set_attn_implementation("sdpa")
    try:
        return hf_greedy(model, ids, n)
    finally:
        model.set_attn_implementation("eagle_fsd")


def test_window_convention_is_transformers():
    """within_window is transformers' sliding-window overlay: query p sees key k iff p - k < window (and k <= p)."""
    n = 9
    for window in (1, 2, 3, 5):
        theirs = sdpa_mask(batch_size=1, q_length=n, kv_length=n, mask_function=sliding_window_causal_mask_function(
            window), allow_is_causal_skip=False)[0, 0]
        pos = torch.arange(n)
        ours = causal_mask(0, n, "cpu")[0, 0] & attention.within_window(pos, pos, window)
        assert torch.equal(ours, theirs)


def test_layer_windows_from_config():
    assert attention.layer_windows(sliding_model("mistral", 4).config) == [4, 4, 4]
    assert attention.layer_windows(sliding_model("qwen2", 3).config) == [3, 3, 3]
    assert attention.layer_windows(sliding_model("mixed", 5).config) == [None, 5, 5]
    assert attention.layer_windows(tiny_config("qwen2", max_window_layers=0)) == [None, None]  # window off
    assert attention.layer_windows(tiny_config("llama")) == [None, None]


@pytest.mark.parametrize("kind,window", [("mistral", 3), ("qwen2", 4), ("mixed", 3), ("mixed_sf", 5)])
def test_tree_verification_logits_equal_path_forwards(kind, window):
    """One tree forward on top of a prefix longer than the window: every node's logits equal transformers' own
    forward of prefix + the node's root path. The nodes are in level order, as drafted trees are, so a node's cache
    slot (committed + index) is not its position (committed + depth), and the deepest path (depth 5) crosses the
    window inside the tree."""
    target = sliding_model(kind, window)
    prefix = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(0))
    # depth 1: 1, 2; depth 2: 3 (of 1), 4 (of 2), 5 (of 1); depth 3: 6 (of 3); depth 4: 7 (of 6); depth 5: 8 (of 7)
    parents = torch.tensor([-1, 0, 0, 1, 2, 1, 3, 6, 7])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 3, 4, 5])
    tokens = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(1))
    anc = ancestor_table(parents, depths, 5)
    cache = TreeCache(LAYERS, 32)
    with torch.no_grad():
        decoder_forward(target, prefix, cache, causal_mask(0, 8, "cpu"), torch.arange(8))
        hidden = decoder_forward(target, tokens, cache, prefix_tree_mask(8, tree_mask_from_ancestors(anc, depths)),
                                 8 + depths)
        logits = target.lm_head(hidden)
        target.set_attn_implementation("sdpa")
        for node in range(9):
            path = [int(a) for a in anc[node] if a >= 0]
            ref = target(torch.cat([prefix, tokens[path]])[None]).logits[0, -1]
            assert torch.allclose(logits[node], ref, atol=1e-5), (kind, window, node)
        target.set_attn_implementation("eagle_fsd")


SHAPES = [(12, 5, 3), (8, 5, 1), (30, 3, 3)]  # (total_token, depth, top_k)


@pytest.mark.parametrize("kind,window", [("mistral", 3), ("qwen2", 4), ("mixed", 3), ("mixed_sf", 5)])
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_equals_transformers_greedy_lm_drafter(kind, window, shape):
    """LM drafter with its own (different) window; prompt of 10 tokens, longer than every window."""
    target = sliding_model(kind, window)
    drafter = LMDrafter(sliding_model("mixed" if kind == "mistral" else "mistral", window + 1, seed=7), VOCAB)
    model = EaFsdModel(target, None, drafter, *shape)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(sum(shape) + window))
    out = model.generate(ids, max_new_tokens=30, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, reference_greedy(target, ids, 30))


@pytest.mark.parametrize("kind,window", [("mistral", 4), ("mixed", 3)])
def test_greedy_equals_transformers_greedy_eagle_head(kind, window):
    target = sliding_model(kind, window)
    torch.manual_seed(7)
    head = EagleHead(tiny_config("llama", vocab=VOCAB, num_hidden_layers=1)).eval()
    model = EaFsdModel(target, None, EagleDrafter(head, target), 12, 4, 3)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, max_new_tokens=30, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, reference_greedy(target, ids, 30))


def greedy_chain_depth(tree) -> int:
    """Depth of the first-sibling chain from the root: the drafter's own greedy continuation inside the tree."""
    child, node, depth = top_child(tree).tolist(), 0, 0
    while child[node] >= 0:
        node, depth = child[node], depth + 1
    return depth


@pytest.mark.parametrize("kind,window", [("mistral", 3), ("mixed", 4), ("qwen2", 5)])
@pytest.mark.parametrize("shape", [(7, 6, 1), (14, 6, 2)])
def test_self_drafting_accepts_the_whole_greedy_chain(kind, window, shape, monkeypatch):
    """The target drafting for itself, trees deeper than the window: the drafter's forwards (prefill, level forwards
    over earlier levels' scratch entries, extension) need the window too, and so does verification of nodes whose
    cache slot is not their position, and the cache compaction of accepted paths that are not 0..a (top_k = 2).
    With all of it right the target's greedy continuation is the drafter's, so every step accepts the drafter's
    whole greedy chain in its tree."""
    import eagle_fsd.fsd

    steps = []
    walk = eagle_fsd.fsd.accept
    monkeypatch.setattr(eagle_fsd.fsd, "accept", lambda tree, *a, **k: steps.append(
        (greedy_chain_depth(tree), walk(tree, *a, **k))) or steps[-1][1])
    target = sliding_model(kind, window)
    model = EaFsdModel(target, None, LMDrafter(target, VOCAB), *shape)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(window))
    out = model.generate(ids, max_new_tokens=36, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, reference_greedy(target, ids, 36))
    assert [step.accept_length for _, step in steps] == [chain for chain, _ in steps]
    assert min(chain for chain, _ in steps) >= 2


@pytest.mark.parametrize("kind,kernel_layers", [("qwen2", 0), ("mixed", 1)])
def test_triton_backend_falls_back_to_sdpa_on_sliding_layers(kind, kernel_layers, monkeypatch):
    """backend "triton": the kernel (it sees the whole prefix, no window) runs the full layers only -- none of an
    all-sliding model, the one full layer of a mixed one -- and the output is still the target's greedy."""
    import eagle_fsd.kernels

    calls = []
    kernel = eagle_fsd.kernels.tree_attention
    monkeypatch.setattr(eagle_fsd.kernels, "tree_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    layers = []  # the layer of every SDPA call
    sdpa = attention.sdpa

    def counting_sdpa(module, *args, **kwargs):
        layers.append(module.layer_idx)
        return sdpa(module, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa", counting_sdpa)
    target = sliding_model(kind, 3)
    drafter = LMDrafter(target, VOCAB)
    model = EaFsdModel(target, None, drafter, plan=plan_for(target, drafter, TreeShape(8, 4, 2), backend="triton"))
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    out = model.generate(ids, max_new_tokens=12, eos_token_id=[], return_dict=True)
    sliding = {i for i, w in enumerate(attention.layer_windows(target.config)) if w is not None}
    assert set(layers) == sliding  # SDPA serves the sliding layers only
    forwards = len(layers) // len(sliding)  # each forward (prefill, draft level, verify, catch-up) runs each once
    assert len(calls) == kernel_layers * forwards
    assert torch.equal(out.sequences, reference_greedy(target, ids, 12))


@pytest.mark.parametrize("bad", ["chunked_attention", "linear_attention"])
def test_unsupported_attention_kinds_are_refused(bad):
    target = tiny_model("qwen2", vocab=VOCAB, seed=1, layer_types=["full_attention", bad])
    with pytest.raises(ValueError, match=f"layer 1 .*{bad}"):
        LMDrafter(target, VOCAB)
    with pytest.raises(ValueError, match=bad):
        EaFsdModel(target).naive_generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2)


@pytest.mark.parametrize("kind,packs", [("llama", 1), ("mixed", 1), ("qwen2", 0)])
def test_one_forward_packs_its_tree_block_once(kind, packs, monkeypatch):
    """The packed tree block lives in the forward's own state: packed once for all the full layers of a forward
    (none when every layer slides), again for the next forward, and the backend is the one that forward was given."""
    import eagle_fsd.kernels

    packed = []
    pack = eagle_fsd.kernels.pack_tree_mask
    monkeypatch.setattr(eagle_fsd.kernels, "pack_tree_mask", lambda *a, **k: packed.append(1) or pack(*a, **k))
    model = tiny_model("llama", vocab=VOCAB, seed=1, num_hidden_layers=LAYERS) if kind == "llama" \
        else sliding_model(kind, 3)
    cache = TreeCache(LAYERS, 32)
    ids = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(2))
    decoder_forward(model, ids, cache, causal_mask(0, 8, "cpu"), torch.arange(8), ModelRun(backend="sdpa"))
    assert packed == []  # SDPA never packs
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    for forward in (1, 2):
        decoder_forward(model, ids[:3], cache, prefix_tree_mask(8, tree), 8 + torch.tensor([0, 1, 1]),
                        ModelRun(backend="triton"))
        cache.crop(8)
        assert len(packed) == packs * forward


def test_attention_outside_an_engine_forward_is_transformers_own():
    """Without a forward state (transformers' own generate) the mask is used as transformers built it, with the
    "auto" backend: the same greedy tokens as transformers' SDPA attention."""
    target = sliding_model("mixed", 3)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    assert torch.equal(hf_greedy(target, ids, 12), reference_greedy(target, ids, 12))
