"""The engine's SDPA path (eagle_fsd.attention.sdpa): grouped key/value heads read in place on a CPU, with the
result of transformers' own SDPA path (to the bit where it copies the heads) and of a float64 reference."""
import math

import pytest
import torch
from transformers.integrations import sdpa_attention

from eagle_fsd.attention import SDPA_GQA, sdpa
from eagle_fsd.drafting import LMDrafter
from eagle_fsd.eval.gpu_check import random_tree_mask
from eagle_fsd.hf import prefix_tree_mask
from eagle_fsd.loading import plan_for
from eagle_fsd.model import EaFsdModel
from eagle_fsd.tree.shape import TreeShape
from tiny import hf_greedy, tiny_model

pytestmark = pytest.mark.skipif(not SDPA_GQA, reason="torch < 2.5 has no enable_gqa: transformers' path is used")


def copied(*args, **kwargs):
    raise AssertionError("the key/value heads were copied once per query head")


class Layer(torch.nn.Module):
    """What SDPA reads of an attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def reference(q, k, v, mask, scale):
    """softmax(q k^T * scale, masked) v in float64, query head h reading key/value head h // (H / H_kv)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    return scores.masked_fill(~mask, -math.inf).softmax(-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("n", [1, 3, 7])
def test_grouped_heads_in_place_match_transformers_and_float64(monkeypatch, dtype, heads, kv_heads, n):
    g = torch.Generator().manual_seed(100 * heads + 10 * kv_heads + n)
    prefix, d = 37, 16
    q = torch.randn(1, heads, n, d, generator=g, dtype=dtype)
    k = torch.randn(1, kv_heads, prefix + n, d, generator=g, dtype=dtype)
    v = torch.randn(1, kv_heads, prefix + n, d, generator=g, dtype=dtype)
    mask = prefix_tree_mask(prefix, random_tree_mask(n, g))
    layer, scale = Layer(heads // kv_heads), d ** -0.5
    want, _ = sdpa_attention.sdpa_attention_forward(layer, q, k, v, mask, scaling=scale)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", copied)
    got, _ = sdpa(layer, q, k, v, mask, scaling=scale)
    assert got.shape == (1, n, heads, d) and got.dtype == dtype
    if n > 1 or heads == kv_heads:  # transformers copies the heads: the same sums, the same bits
        assert torch.equal(got, want)
    else:  # one query: transformers folds the group into the query rows instead, summing in another order
        torch.testing.assert_close(got, want)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, scale).transpose(1, 2), rtol=0, atol=tolerance)


def test_engine_forwards_read_grouped_heads_in_place(monkeypatch):
    """Every forward of the loop (prefill, tree levels, catch-up, verification) attends without copying heads, and
    speculation still gives the target's greedy tokens."""
    target = tiny_model("qwen2", seed=1)  # 4 query heads over 2 key/value heads
    ids = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(1))
    want = hf_greedy(target, ids, 12)
    monkeypatch.setattr(sdpa_attention, "repeat_kv", copied)
    drafter = LMDrafter(target, 1000)
    model = EaFsdModel(target, None, drafter, plan=plan_for(target, drafter, TreeShape(6, 3, 2), backend="sdpa"))
    assert torch.equal(model.generate(ids, max_new_tokens=12, eos_token_id=[]), want)
