"""EAGLE-3 training: the training-time-test unroll equals drafting the chain it represents, the draft vocabulary,
and `train-head --arch eagle3` end to end (the head it writes loads in every layout and drafts)."""
import pytest
import torch

from eagle_fsd.drafting.eagle3 import Eagle3Drafter, default_aux_indices, load_eagle3_head
from eagle_fsd.train.eagle3 import Eagle3Loss, draft_vocabulary, new_eagle3_head, ttt_unroll
from eagle_fsd.train.features import target_features
from tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_model(num_hidden_layers=8, seed=3)


def _features(target, ids):
    layers = default_aux_indices(target.config.num_hidden_layers)
    rows = target_features(target, [(ids, torch.ones_like(ids, dtype=torch.bool))], layers=layers)[0]
    return rows[:, : 3 * target.config.hidden_size]


def _chain_logits(head, target, ids, aux, t, depth):
    """Logits of drafting depth 1..depth from prefix t one forward at a time, as generation does: the prefix
    (x_1..x_{t+1} with features aux_0..aux_t), then one chain node per level fed the draft's own state."""
    drafter = Eagle3Drafter(head, target)
    drafter.reset(64)
    logits, state = drafter.extend(ids[1: t + 2], aux[: t + 1])
    out = [logits]
    for level in range(depth - 1):
        token = ids[t + 2 + level].reshape(1)
        level_logits, states = drafter.forward_level(token, state[None], level,
                                                     torch.ones(1, level + 1, dtype=torch.bool))
        out.append(level_logits[0])
        state = states[0]
    return out


def test_ttt_unroll_equals_the_chain_it_represents(target):
    torch.manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (14,))
    draft_ids = torch.randperm(target.config.vocab_size)[:300].sort().values
    head = new_eagle3_head(target, draft_ids, seed=1).eval()
    with torch.no_grad():
        head.midlayer.hidden_norm.weight.uniform_(0.5, 1.5)  # distinguish the norms from their initial ones
        aux = _features(target, ids)
        steps = list(ttt_unroll(head, target.get_input_embeddings(), ids[None], aux[None], 4))
        for t in (0, 3, 8):
            chain = _chain_logits(head, target, ids, aux, t, 4)
            for j, logits in steps:
                torch.testing.assert_close(logits[0, t], chain[j], rtol=1e-4, atol=1e-4)


def test_draft_vocabulary_most_frequent_reply_tokens():
    ids = torch.tensor([5, 5, 5, 7, 7, 2, 9, 9, 9, 9, 1])
    mask = torch.tensor([True] * 10 + [False])  # token 1 is in the prompt only
    vocab = draft_vocabulary([(ids, mask)], vocab_size=12, size=3)
    assert vocab.tolist() == [5, 7, 9]
    tie = draft_vocabulary([(torch.tensor([4, 3]), torch.tensor([True, True]))], vocab_size=12, size=1)
    assert tie.tolist() == [3]  # equal counts: the lower id
    assert draft_vocabulary([(ids, mask)], vocab_size=12, size=50).numel() == 12  # capped, filled with unseen ids


def test_new_head_maps_draft_ids_to_target_ids(target):
    draft_ids = torch.tensor([3, 10, 11, 500])
    head = new_eagle3_head(target, draft_ids)
    assert head.draft_to_target_ids().tolist() == draft_ids.tolist()
    assert head.t2d.nonzero().flatten().tolist() == draft_ids.tolist()
    torch.testing.assert_close(head.lm_head.weight, target.get_output_embeddings().weight[draft_ids])


def test_loss_counts_only_assistant_positions_with_target_argmax_in_vocab(target):
    torch.manual_seed(1)
    ids = torch.randint(0, target.config.vocab_size, (1, 12))
    layers = default_aux_indices(target.config.num_hidden_layers)
    hidden = target_features(target, [(ids[0], torch.ones(12, dtype=torch.bool))], layers=layers)[0][None]
    full = torch.arange(target.config.vocab_size)
    head = new_eagle3_head(target, full)
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, 4:9] = True
    parts = Eagle3Loss(steps=3)(head, target.get_input_embeddings(), target.get_output_embeddings(), ids, mask, hidden)
    # step j counts index t when x_{t+1+j} is an assistant token: 5, 5, 5 positions (t + 1 + j in 4..8, t <= 10)
    assert [n for _, n in parts.by_step] == [5, 5, 5]
    parts.loss.backward()
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="ttt_steps=0"):
        Eagle3Loss(steps=0)
