"""EAGLE-3 heads in the generation loop on real SmolLM2-135M weights (fp32): loaded from each published layout
through from_pretrained, the greedy output is the target's own for several tree shapes, and FSD works over the
head's draft vocabulary (q = 0 outside it)."""
import math

import pytest
import torch

from eagle_fsd import presets
from eagle_fsd.drafting.eagle3 import Eagle3Drafter
from eagle_fsd.eagle3_export import save_eagle3_head
from eagle_fsd.fsd import FsdConfig
from eagle_fsd.model import EaFsdModel
from eagle_fsd.train.eagle3 import new_eagle3_head

pytestmark = pytest.mark.slow
PROMPT = "List three prime numbers and explain why they are prime."


@pytest.fixture(scope="module")
def head_dirs(tmp_path_factory):
    """One random EAGLE-3 head over a 4,096-token draft vocabulary, written in the three layouts."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(presets.resolve_model("smollm2-135m-instruct"),
                                                  dtype=torch.float32).eval()
    draft_ids = torch.arange(0, target.config.vocab_size, 12)[:4096]
    head = new_eagle3_head(target, draft_ids, seed=0)
    dirs = {}
    for layout in ("eagle", "sglang", "speculators"):
        dirs[layout] = tmp_path_factory.mktemp(layout)
        save_eagle3_head(head, str(dirs[layout]), layout, target.config)
    return dirs


def encode(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


@pytest.mark.parametrize("layout,shape", [("eagle", (60, 5, 10)), ("sglang", (16, 3, 4)), ("speculators", (8, 7, 1))])
def test_greedy_is_the_targets_greedy(head_dirs, layout, shape):
    model = EaFsdModel.from_pretrained("smollm2-135m-instruct", ea_model_path=str(head_dirs[layout]),
                                       dtype=torch.float32, total_token=shape[0], depth=shape[1], top_k=shape[2])
    assert isinstance(model.drafter, Eagle3Drafter)
    assert model.drafter.feature_layers == (2, 15, 27)  # the inputs of layers 2, N//2, N-3 of 30
    ids = encode(model.tokenizer, PROMPT)
    reference = model.base_model.generate(ids, do_sample=False, max_new_tokens=40)
    out = model.generate(ids, max_new_tokens=40, return_dict=True)
    assert torch.equal(out.sequences, reference)
    tree_tokens = set()
    drafter = model.drafter
    drafter.reset(256)
    logits, _ = drafter.prefill(ids[0], reference[0, ids.shape[1]], torch.zeros(ids.shape[1], 3 * 576))
    assert logits.shape == (4096,)  # scores over the draft vocabulary, mapped to target ids by the tree code
    tree_tokens.update(drafter.draft_vocab[logits.topk(5).indices].tolist())
    assert all(t % 12 == 0 for t in tree_tokens)


def test_fsd_at_infinite_threshold_accepts_whole_chains(head_dirs):
    """T = inf (reducible, kl_qp): the top child is accepted wherever the lossless rule rejects, so a chain tree of
    depth 7 emits 8 tokens per step (until the budget ends the last one)."""
    model = EaFsdModel.from_pretrained("smollm2-135m-instruct", ea_model_path=str(head_dirs["eagle"]),
                                       dtype=torch.float32, total_token=8, depth=7, top_k=1)
    ids = encode(model.tokenizer, PROMPT)
    out = model.generate(ids, max_new_tokens=32, eos_token_id=[], return_dict=True,
                         fsd=FsdConfig(threshold=math.inf, divergence="kl_qp"))
    assert out.accept_lengths[:-1] == [7] * (len(out.accept_lengths) - 1)
    assert out.fuzzy_fraction > 0.5  # a random head: nearly all of them only FSD accepted
