"""A rule's rescue rate by replay along the target's greedy continuations of the calibration prompts.

At each position j of a continuation g the target's distribution p_j (its logits after g[..j]) and the drafter's
q_j (its root distribution there, reading the target's true features) are both known, and so is whether the
drafter's first choice is the target's (g[j + 1]): the lossless verdict of a top-1 draft at depth 1. The rule's
verdict there is the FSD chain rule (eagle_fsd.fsd) on D_j = Div(p_j, q_j) with the rule's guards. The rescue rate
(eagle_fsd.tune.follow) is the change from the lossless share of accepted positions alpha0 to the rule's alpha:
(alpha - alpha0) / (1 - alpha0) when the rule accepts more, alpha / alpha0 - 1 when it accepts less (the original
rule blocks matches above T). Approximations, stated: every depth is moved by the depth-1 rate (deeper drafts read
the drafter's own features, so their q is further from p and their true rate lower), and after a fuzzy acceptance
the context is taken to be the continuation's.
"""
from __future__ import annotations

import math

import torch

from eagle_fsd.cache import TreeCache
from eagle_fsd.divergence import align_vocab, divergence
from eagle_fsd.fsd import FsdConfig, below_threshold, fuzzy_allowed, reducible_chain
from eagle_fsd.hf import causal_mask, decoder_outputs
from eagle_fsd.tune.measure import TuneSettings, calibration_prompts


def rule_verdicts(target_logits: torch.Tensor, draft_logprobs: torch.Tensor, fsd: FsdConfig, vocab_size: int,
                  stop_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lossless, rule): (m,) bool verdicts on a top-1 draft at m positions. Row i: the target's logits and the
    drafter's log-probabilities over the target's vocabulary (-inf outside a reduced draft vocabulary)."""
    target_choice = target_logits[:, :vocab_size].argmax(-1)
    draft_choice = draft_logprobs[:, :vocab_size].argmax(-1)
    lossless = draft_choice == target_choice
    p, q = align_vocab(target_logits.float(), draft_logprobs.float(), vocab_size)
    div = divergence(p, q, fsd.divergence, top_k=fsd.top_k)
    allowed = fuzzy_allowed(target_logits, draft_choice, target_choice, fsd, vocab_size, stop_ids)
    div = torch.where(allowed, div, math.nan)
    if fsd.mode == "original":
        return lossless, div.double() <= fsd.threshold
    return lossless, reducible_chain(lossless, div, fsd.threshold)


def rescue_of(lossless: torch.Tensor, rule: torch.Tensor) -> float:
    """The rescue rate f from the two verdicts (module docstring)."""
    alpha0, alpha = lossless.float().mean().item(), rule.float().mean().item()
    if alpha >= alpha0:
        return (alpha - alpha0) / (1.0 - alpha0) if alpha0 < 1.0 else 0.0
    return alpha / alpha0 - 1.0


@torch.no_grad()
def continuation_signals(model, sequence: torch.Tensor, prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits, drafter log-probabilities over the target's vocabulary) at every continuation position but
    the last: row j predicts the continuation's token j + 1."""
    target, drafter = model.base_model, model.drafter
    ids, p = sequence.to(target.device), prompt_length
    cache = TreeCache.for_model(target, ids.numel(), model.plan.target)
    hidden, features = decoder_outputs(target, ids, cache, causal_mask(0, ids.numel(), target.device),
                                       torch.arange(ids.numel(), device=target.device), model.plan.target,
                                       drafter.feature_layers)
    target_logits = target.get_output_embeddings()(hidden[p:-1]).float()
    drafter.reset(ids.numel() + 2)
    logits, _ = drafter.prefill(ids[:p], ids[p], features[:p])
    rows = [logits]
    for j in range(ids.numel() - p - 2):
        logits, _ = drafter.extend(ids[p + j + 1: p + j + 2], features[p + j: p + j + 1])
        rows.append(logits)
    draft = torch.log_softmax(torch.stack([r.reshape(-1) for r in rows]).float(), dim=-1)
    vocab = drafter.draft_vocab
    if vocab is not None:  # a reduced vocabulary scores its own columns: place them among the target's
        full = torch.full((draft.shape[0], target_logits.shape[-1]), -math.inf, device=draft.device)
        draft = full.index_copy_(1, vocab.to(draft.device), draft)
    return target_logits, draft


def rule_rescue(model, sequences: list[tuple[list[int], int]], fsd: FsdConfig,
                stop_ids: torch.Tensor | None = None) -> float:
    """The rescue rate of rule `fsd` over the calibration sequences ((prompt + continuation ids, prompt length))."""
    lossless, rule = [], []
    for ids, prompt_length in sequences:
        target_logits, draft = continuation_signals(model, torch.tensor(ids), prompt_length)
        a, b = rule_verdicts(target_logits, draft, fsd, model.vocab_size, stop_ids)
        lossless.append(a)
        rule.append(b)
    return rescue_of(torch.cat(lossless), torch.cat(rule))


def calibration_sequences(model, profile) -> list[tuple[list[int], int]]:
    """The profile's calibration sequences; for a profile cached before it kept them, the target's greedy
    continuations of the shipped calibration prompts, decoded once and kept on the profile (in memory)."""
    if not profile.calibration:
        settings = TuneSettings()
        for x in calibration_prompts(model.tokenizer, settings.prompts, settings.prompt_texts):
            out = model.naive_generate(x, max_new_tokens=settings.new_tokens, return_dict=True)
            profile.calibration.append([out.sequences[0].tolist(), x.shape[1]])
    return [(ids, length) for ids, length in profile.calibration]
