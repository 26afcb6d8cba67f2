"""The EAGLE-1/2 training loss (eagle2.md section 6.3): feature regression plus a soft cross-entropy against the
target's next-token distribution. A loss with the same signature and LossParts result (e.g. EAGLE-3's unrolled
training-time test) can replace `head_loss` in the loop."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle_fsd.drafting import EagleHead


@dataclass
class LossParts:
    loss: torch.Tensor
    v_loss: float
    p_loss: float
    correct: int
    count: int
    by_step: list[tuple[int, int]] | None = None  # (correct, count) per unroll step of a multi-step loss


@dataclass(frozen=True)
class LossSettings:
    """loss = v_weight * SmoothL1(pred, f_{t+1}) + p_weight * soft cross-entropy, the input features f_t perturbed
    by uniform noise of width `noise` (0: none)."""
    noise: float = 0.0
    v_weight: float = 1.0
    p_weight: float = 0.1


def head_loss(head: EagleHead, embed: nn.Module, lm_head: nn.Module, ids, mask, hidden,
              settings: LossSettings = LossSettings(), generator: torch.Generator | None = None) -> LossParts:
    """EAGLE-1/2 loss of a batch. Position t reads (embed(x_{t+1}), f_t [+ noise]) and predicts f_{t+1}; positions
    count where x_{t+1} is an assistant token. The target (embed, lm_head) should be frozen (requires_grad False),
    as train() leaves it: gradients then flow through lm_head into the head only."""
    feats = hidden[:, :-1].float()
    if settings.noise > 0:
        feats = feats + (torch.rand(feats.shape, generator=generator, device=feats.device) - 0.5) * settings.noise
    length = feats.shape[1]
    positions = torch.arange(length, device=ids.device)[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        emb = embed(ids[:, 1:]).to(feats.dtype)  # the head trains in fp32 (under autocast when bf16) for any target
    pred = head(emb, feats, positions, None)
    sel = mask[:, 1:]
    p = pred[sel].float()
    t = hidden[:, 1:][sel].float()
    count = p.shape[0]
    if count == 0:
        zero = pred.sum() * 0
        return LossParts(zero, 0.0, 0.0, 0, 0)
    v_loss = F.smooth_l1_loss(p, t)
    logits_dtype = lm_head.weight.dtype
    with torch.no_grad():
        target_p = torch.softmax(lm_head(t.to(logits_dtype)).float(), -1)
    logp = torch.log_softmax(lm_head(p.to(logits_dtype)).float(), -1)
    p_loss = -(target_p * logp).sum(-1).mean()
    correct = int((logp.argmax(-1) == target_p.argmax(-1)).sum())
    loss = settings.v_weight * v_loss + settings.p_weight * p_loss
    return LossParts(loss, v_loss.item(), p_loss.item(), correct, count)
