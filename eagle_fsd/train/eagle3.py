"""EAGLE-3 training (eagle3.md; EAGLE-3 paper arXiv 2503.01840): the draft vocabulary, a new head, and the
training-time test (TTT) loss.

Features: for every token the hidden states entering the target's aux layers (default 2, N//2, N-3), concatenated
(3H), followed by the target's last hidden state after the final norm (H), so one shard row is 4H wide.

TTT, unroll step j (0-based), index t: the head reads (embed(x_{t+1+j}), g) at position t + j, where g = fc(aux_t)
at j = 0 and g = the head's own output of step j-1 at index t after that; it attends to step 0's keys at indices
<= t (the real prefix) and to the keys of steps 1..j at index t (its own chain): exactly what drafting depth j from
prefix t sees at inference. Its logits over the draft vocabulary V_d are scored against the target's distribution
after x_{t+1+j} restricted to V_d, p = softmax(final_{t+1+j} W_d^T):
    loss = sum_j decay^j * mean_t [ -sum_v p_v log q_v ]
over positions where x_{t+1+j} is an assistant token and the target's full-vocabulary argmax there lies in V_d."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig

from eagle_fsd.drafting.eagle3 import Eagle3Head
from eagle_fsd.train.head import head_raw_config
from eagle_fsd.train.loss import LossParts, LossSettings


def draft_vocabulary(samples, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` target ids most frequent among the assistant tokens of `samples` ([(ids, mask)]), in ascending id
    order (count ties broken by the lower id; ids never seen fill up the end, so the size is exact)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in samples:
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    size = min(size, vocab_size)
    order = torch.argsort(-counts * vocab_size + torch.arange(vocab_size))
    return order[:size].sort().values


def new_eagle3_head(target, draft_ids: torch.Tensor, seed: int = 0) -> Eagle3Head:
    """A fresh head for `target` over the draft vocabulary `draft_ids` (target ids): Llama fields and RoPE from the
    target, lm_head initialised from the target's lm_head rows of the draft vocabulary, d2t / t2d set."""
    raw = {k: v for k, v in head_raw_config(target.config).items()
           if k not in ("bias", "qkv_bias", "architectures", "torch_dtype")}
    config = LlamaConfig(**raw)
    config._attn_implementation = "sdpa"  # training: explicit boolean masks through SDPA
    torch.manual_seed(seed)
    head = Eagle3Head(config, draft_vocab_size=draft_ids.numel())
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids].float())
        head.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    return head


def ttt_mask(length: int, step: int, device) -> torch.Tensor:
    """(1, 1, L, L * (step + 1)) bool: step 0's keys causally, then one diagonal block per earlier unroll step.
    Right padding needs no mask: a counted query never reaches a padded key."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    diag = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)[None, None]


def _shift(x: torch.Tensor, j: int, length: int) -> torch.Tensor:
    """x[:, 1 + j : 1 + j + length] along dim 1, zero-padded at the end: the value at index t + 1 + j."""
    pad = [0, 0] * (x.dim() - 2) + [0, j]
    return F.pad(x[:, 1 + j:], pad)[:, :length]


def ttt_unroll(head: Eagle3Head, embed, ids: torch.Tensor, aux: torch.Tensor, steps: int):
    """Yield (j, draft logits (B, L, V_d)) for unroll steps j = 0..steps-1 of the training-time test over token ids
    (B, T) and target features aux (B, T, 3H); L = T - 1, index t of step j drafts depth j + 1 from prefix t."""
    length = ids.shape[1] - 1
    state, cache = aux[:, :-1], DynamicCache()
    for j in range(steps):
        positions = (torch.arange(length, device=ids.device) + j)[None].expand(ids.shape[0], -1)
        with torch.no_grad():
            emb = embed(_shift(ids, j, length)).float()
        state, logits = head(emb, state, positions, ttt_mask(length, j, ids.device), cache)
        yield j, logits


class Eagle3Loss:
    """The TTT loss with the signature of `loss.head_loss` (its LossSettings and generator are EAGLE-2's, unused).
    LossParts.correct / count: step 0 (depth-1 agreement); `by_step` holds (correct, count) of every step."""

    def __init__(self, steps: int = 7, decay: float = 0.8):
        if steps < 1:
            raise ValueError(f"ttt_steps={steps!r} must be >= 1 (EAGLE-3 uses 7)")
        self.steps, self.decay = steps, decay

    def __call__(self, head: Eagle3Head, embed, lm_head, ids, mask, hidden, settings: LossSettings | None = None,
                 generator=None) -> LossParts:
        width = hidden.shape[-1] - head.config.hidden_size
        aux, final = hidden[..., :width], hidden[..., width:]
        with torch.no_grad():
            top = lm_head(final.to(lm_head.weight.dtype)).argmax(-1)
            target_logits = final.float() @ lm_head.weight[head.draft_to_target_ids()].float().T  # (B, T, V_d)
            counted_all = mask & head.t2d[top]
        length = ids.shape[1] - 1
        total, by_step = None, []
        for j, logits in ttt_unroll(head, embed, ids, aux, self.steps):
            counted = _shift(counted_all, j, length)
            p = torch.softmax(_shift(target_logits, j, length)[counted], -1)
            logq = torch.log_softmax(logits[counted].float(), -1)
            ce = -(p * logq).sum(-1).mean() if p.shape[0] else logits.sum() * 0
            total = self.decay ** j * ce if total is None else total + self.decay ** j * ce
            by_step.append((int((logq.argmax(-1) == p.argmax(-1)).sum()), p.shape[0]))
        first = by_step[0]
        return LossParts(total, 0.0, float(total.detach()), first[0], first[1], by_step)
