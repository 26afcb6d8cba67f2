"""The generation loop on tiny random models: exact greedy parity, stopping rules, statistics, errors, sampling law."""
import pytest
import torch

from eagle_fsd.drafting import EagleDrafter, EagleHead, LMDrafter
from eagle_fsd.loading import plan_for
from eagle_fsd.model import EaFsdModel
from eagle_fsd.tree.shape import TreeShape
from tiny import hf_greedy, tiny_config, tiny_model

SHAPES = [(60, 5, 10), (12, 1, 4), (8, 5, 1), (2, 1, 1), (30, 3, 3)]  # (total_token, depth, top_k)


def make_drafter(kind_of_drafter, target, kind, seed=7):
    if kind_of_drafter == "self":  # the target drafts for itself: long accepted paths
        return LMDrafter(target, target.config.vocab_size)
    if kind_of_drafter == "lm":
        return LMDrafter(tiny_model(kind, seed=seed), target.config.vocab_size)
    torch.manual_seed(seed)
    cfg = tiny_config("llama", num_hidden_layers=1)
    return EagleDrafter(EagleHead(cfg).eval(), target)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("drafter_kind", ["self", "lm", "eagle"])
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_equals_target_greedy(kind, drafter_kind, shape):
    target = tiny_model(kind, seed=1)
    total_token, depth, top_k = shape
    model = EaFsdModel(target, None, make_drafter(drafter_kind, target, kind), total_token, depth, top_k)
    ids = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(sum(shape)))
    out = model.generate(ids, max_new_tokens=40, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 40))
    assert out.new_tokens == 40 and out.verify_steps == len(out.accept_lengths)
    assert all(0 <= a <= depth + 1 for a in out.accept_lengths)
    if drafter_kind == "self":
        assert out.tau > 1.5  # the target drafting for itself must get multi-token steps accepted


def test_naive_generate_equals_target_greedy():
    target = tiny_model("qwen2", seed=3)
    model = EaFsdModel(target)
    ids = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(0))
    out = model.naive_generate(ids, max_new_tokens=25, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 25))
    assert out.accept_lengths == [0] * 24 and out.tau == 1.0


def step_spans(out):
    """[start, end) of the tokens each step emitted: the prefill token, then accept_length + 1 per step."""
    spans, pos = [(0, 1)], 1
    for a in out.accept_lengths:
        spans.append((pos, pos + a + 1)); pos += a + 1
    return spans


def self_drafting_model(seed=1):
    target = tiny_model("llama", seed=seed)
    return target, EaFsdModel(target, None, LMDrafter(target, 1000), total_token=12, depth=5, top_k=1)


def test_eos_inside_an_accepted_path_stops_there():
    target, model = self_drafting_model()
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(5))
    full = model.generate(ids, max_new_tokens=60, eos_token_id=[], return_dict=True)
    new = full.sequences[0, 8:].tolist()
    # an eos candidate: first occurrence of a token that sits strictly inside a multi-token step
    cut = next(j for s, e in step_spans(full) for j in range(s, e - 1) if new.index(new[j]) == j)
    out = model.generate(ids, max_new_tokens=60, eos_token_id=new[cut], return_dict=True)
    assert out.sequences[0, 8:].tolist() == new[: cut + 1]
    assert out.new_tokens == cut + 1


def test_max_new_tokens_inside_an_accepted_path():
    target, model = self_drafting_model()
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(6))
    full = model.generate(ids, max_new_tokens=60, eos_token_id=[], return_dict=True)
    s, e = next((s, e) for s, e in step_spans(full) if e - s >= 3)
    budget = s + 1  # ends one token into a step that accepted >= 2 draft tokens
    out = model.generate(ids, max_new_tokens=budget, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, full.sequences[:, : 8 + budget])
    assert out.new_tokens == budget


def test_streamer_receives_exactly_the_output():
    class Collect:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    target, model = self_drafting_model()
    ids = torch.randint(0, 1000, (1, 5), generator=torch.Generator().manual_seed(2))
    streamer = Collect()
    out = model.generate(ids, max_new_tokens=30, eos_token_id=[], streamer=streamer)
    assert streamer.chunks[0] == ids[0].tolist() and streamer.ended
    assert sum(streamer.chunks[1:], []) == out[0, 5:].tolist()


def test_eagle_aliases():
    target, model = self_drafting_model()
    ids = torch.randint(0, 1000, (1, 5), generator=torch.Generator().manual_seed(2))
    seq, new_token, idx = model.eagenerate(ids, max_new_tokens=20, log=True)
    assert torch.equal(seq, hf_greedy(target, ids, 20)[:, : seq.shape[1]])
    plain, plain_new, plain_idx = model.naivegenerate(ids, max_new_tokens=20, log=True)
    assert torch.equal(seq, plain) and plain_idx == plain_new - 2 and new_token == plain_new


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=600), "context"),
])
def test_bad_generate_arguments(kwargs, message):
    target, model = self_drafting_model()
    ids = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        model.generate(ids, **{"max_new_tokens": 10, **kwargs})


def test_bad_shapes_and_tree_arguments():
    target, model = self_drafting_model()
    with pytest.raises(ValueError, match="batch size"):
        model.generate(torch.zeros(2, 5, dtype=torch.long), max_new_tokens=5)
    for bad in (dict(total_token=0), dict(depth=-1), dict(top_k=0)):
        args = {"total_token": 60, "depth": 5, "top_k": 10, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            EaFsdModel(target, None, None, **args)
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        EaFsdModel(target, None, LMDrafter(target, 1000), top_k=5000).generate(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="no drafter"):
        EaFsdModel(target).generate(torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_with_triton_tree_attention(kind, monkeypatch):
    """The Triton kernel (interpreted on CPU) in every forward of target and drafter: still the target's greedy."""
    import eagle_fsd.kernels

    calls = []
    kernel = eagle_fsd.kernels.tree_attention
    monkeypatch.setattr(eagle_fsd.kernels, "tree_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    target = tiny_model(kind, seed=1)
    drafter = tiny_model(kind, seed=1)  # an exact copy drafting for the target: long accepted paths
    drafter = LMDrafter(drafter, 1000)
    model = EaFsdModel(target, None, drafter, plan=plan_for(target, drafter, TreeShape(12, 3, 3), backend="triton"))
    ids = torch.randint(0, 1000, (1, 6), generator=torch.Generator().manual_seed(4))
    out = model.generate(ids, max_new_tokens=12, eos_token_id=[], return_dict=True)
    assert len(calls) >= 2 * 2 * out.verify_steps  # at least every verification layer of the target and drafter
    assert torch.equal(out.sequences, hf_greedy(target, ids, 12))
    assert out.tau > 1.5


# ----------------------------------------------------------------------------- the tree shape, a value
def test_a_shape_passed_to_generate_runs_as_given_and_leaves_the_model_alone(monkeypatch):
    """generate(shape=...) drafts trees of that shape (at most total_token nodes, branching children at the root)
    without the speed guard; the model keeps its own shape and tuning, and greedy output is still the target's."""
    from eagle_fsd.drafting import base
    from eagle_fsd.tree.shape import TreeShape

    target, model = self_drafting_model()
    trees = []
    grow = base.grow_tree
    monkeypatch.setattr(base, "grow_tree", lambda *a: trees.append((a[-1], grow(*a))) or trees[-1][1])
    monkeypatch.setattr(model, "_speed_guard", lambda rule=None: pytest.fail("an explicit shape runs without the guard"))
    ids = torch.randint(0, 1000, (1, 6), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, max_new_tokens=20, eos_token_id=[], return_dict=True, shape=TreeShape(5, 2, 3))
    assert torch.equal(out.sequences, hf_greedy(target, ids, 20))
    assert trees and all(shape == TreeShape(5, 2, 3) and tree.size <= 5 for shape, tree in trees)
    assert model.shape == TreeShape(12, 5, 1) and (model.total_token, model.depth, model.top_k) == (12, 5, 1)
    with pytest.raises(AttributeError):
        model.top_k = 3  # EAGLE's names read the shape; nothing assigns them


@pytest.mark.parametrize("bad", [dict(total_token=0), dict(depth=-1), dict(branching=0), dict(branching=True),
                                 dict(draft_vocab=-1)])
def test_tree_shape_refuses_what_no_tree_has(bad):
    from eagle_fsd.tree.shape import TreeShape

    with pytest.raises(ValueError, match=next(iter(bad))):
        TreeShape(**{"total_token": 8, "depth": 3, "branching": 2, **bad})
    assert TreeShape(8, 3, 2).level_room == 6 and TreeShape(8, 3, 2).eagle() == (8, 3, 2)


@pytest.mark.parametrize("drafter_kind", ["lm", "eagle"])
def test_drafters_share_the_step_contract(drafter_kind):
    """rewind(n) forgets all read after n inputs: extending again from there gives the same logits; a level's
    scratch is dropped by rollback; drafting_over restores the vocabulary it found."""
    target = tiny_model("llama", seed=1)
    drafter = make_drafter(drafter_kind, target, "llama")
    ids = torch.randint(0, 1000, (9,), generator=torch.Generator().manual_seed(5))
    hidden = torch.randn(9, target.config.hidden_size, generator=torch.Generator().manual_seed(6))
    drafter.reset(32)
    drafter.prefill(ids[:5], ids[5], hidden[:5])
    length = drafter.length
    first, _ = drafter.extend(ids[6:8], hidden[5:7])
    drafter.forward_level(ids[8:9], None if drafter_kind == "lm" else hidden[7:8], 0, torch.ones(1, 1, dtype=torch.bool))
    drafter.rollback()
    assert drafter.cache.get_seq_length() == length + 2
    drafter.rewind(length)
    assert drafter.length == length and drafter.cache.get_seq_length() == length
    again, _ = drafter.extend(ids[6:8], hidden[5:7])
    torch.testing.assert_close(again, first)
    ids_kept = torch.arange(0, 1000, 3)
    with drafter.drafting_over(ids_kept):
        assert drafter.draft_vocab is ids_kept and drafter.extend(ids[8:9], hidden[7:8])[0].shape == (334,)
    assert drafter.draft_vocab is None
    assert drafter.auto_quant == (drafter_kind == "lm") and drafter.feature_layers is None
    assert (drafter.assistant_model is not None) == (drafter_kind == "lm")


def test_kept_level_entries_equal_reading_the_chain_again():
    """Branch by branch: an LM drafter that commits a path's forwarded nodes from its tree scratch (keep_levels) and
    reads only the rest holds the same cache and gives the same next logits as one that reads the whole chain."""
    from eagle_fsd.drafting import grow_tree
    from eagle_fsd.tree.dynamic import retrieve_indices
    from eagle_fsd.tree.shape import TreeShape

    target = tiny_model("llama", seed=1)
    drafter = make_drafter("lm", target, "llama")
    ids = torch.randint(0, 1000, (9,), generator=torch.Generator().manual_seed(5))

    def drafted():  # the drafter after reading the prompt and drafting a tree (its scratch filled)
        drafter.reset(40)
        return grow_tree(drafter, ids[-1], *drafter.prefill(ids[:-1], ids[-1]), TreeShape(10, 3, 2))

    tree = drafted()
    length = drafter.length
    paths = retrieve_indices(tree.parents, tree.ancestors, tree.depths)
    kept_counts = []
    for path in paths:
        path = path[path >= 0]
        chain = torch.cat([tree.tokens[path[1:]], torch.tensor([7])])  # accepted tokens, then a bonus token
        drafter.reset(40)
        drafter.prefill(ids[:-1], ids[-1])
        read_logits, _ = drafter.extend(chain)
        read_keys = [layer.keys[:, :, : drafter.length].clone() for layer in drafter.cache.layers]
        drafted()  # the scratch is overwritten by a kept branch: the same tree, drafted again
        slots = tree.level_slots(path)
        kept = int((slots >= 0).cumprod(0).sum())
        kept_counts.append(kept)
        drafter.keep_levels(slots[:kept])
        logits, _ = drafter.extend(chain[kept:])
        assert drafter.length == length + chain.numel()
        torch.testing.assert_close(logits, read_logits)
        for layer, keys in zip(drafter.cache.layers, read_keys):
            torch.testing.assert_close(layer.keys[:, :, : drafter.length], keys)
    assert max(kept_counts) == 3 and min(kept_counts) < 3  # branches through all 3 levels, and shorter ones


def test_an_lm_drafter_reads_only_what_its_levels_did_not():
    """The target drafting for itself on a (4, 2, 1) chain accepts all 3 draft tokens a step; the first two were
    read by the level forwards, so a step's catch-up reads the third and the bonus token: 2 tokens, not 4."""
    from eagle_fsd.tree.shape import TreeShape

    target = tiny_model("llama", seed=1)
    model = EaFsdModel(target, None, LMDrafter(target, 1000), 4, 2, 1)
    reads = []
    extend = model.drafter.extend
    model.drafter.extend = lambda tokens, hidden=None: reads.append(tokens.numel()) or extend(tokens, hidden)
    ids = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, max_new_tokens=40, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 40))
    assert out.accept_lengths[:-1] == [3] * (len(out.accept_lengths) - 1)
    assert reads[0] == 11 and reads[1:] == [2] * (len(reads) - 1)  # prompt + root, then per step


@pytest.mark.parametrize("drafter_kind", ["lm", "eagle"])
def test_the_tuner_times_the_catch_up_a_step_makes(drafter_kind):
    """An LM drafter's catch-up reads the bonus token (its level entries are kept); an EAGLE head reads the accepted
    tokens again with the target's features (three, the tuner's typical step)."""
    from eagle_fsd.tune import DraftSetup

    target = tiny_model("llama", seed=1)
    drafter = make_drafter(drafter_kind, target, "llama")
    context = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(2))
    setup = DraftSetup(drafter, context, torch.randn(12, target.config.hidden_size), room=8)
    reads = []
    extend = drafter.extend
    drafter.extend = lambda tokens, hidden=None: reads.append(tokens.numel()) or extend(tokens, hidden)
    setup.extend()
    assert reads == [1 if drafter_kind == "lm" else 3] and drafter.length == setup.length
