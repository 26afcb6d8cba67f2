"""Target-side token choice: greedy argmax or one sample per row from the processed distribution."""
from __future__ import annotations

import math

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def check_sampling_args(temperature: float, top_p: float, top_k: int) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 means greedy)")
    if not (0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1 disables nucleus sampling)")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k={top_k!r} must be an int >= 0 (0 disables top-k sampling)")


def logits_processor(temperature: float, top_p: float = 1.0, top_k: int = 0) -> LogitsProcessorList | None:
    """transformers' warpers for sampling; None means greedy (temperature 0), as in EAGLE."""
    check_sampling_args(temperature, top_p, top_k)
    if temperature < 1e-5:
        return None
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def processed_probs(logits: torch.Tensor, processor: LogitsProcessorList) -> torch.Tensor:
    """(n, V) logits -> (n, V) fp32 probabilities after temperature / top-k / top-p."""
    scores = processor(None, logits.float())
    return torch.softmax(scores, dim=-1)


def choose_tokens(logits: torch.Tensor, processor: LogitsProcessorList | None) -> torch.Tensor:
    """One target choice per row: argmax when greedy, else one sample of the processed distribution."""
    if processor is None:
        return logits.argmax(dim=-1)
    return torch.multinomial(processed_probs(logits, processor), 1).squeeze(-1)
