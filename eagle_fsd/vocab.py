"""Reduced draft vocabularies (FR-Spec, arXiv 2502.14856): the drafter scores only the most frequent tokens.

A frequency table is the target's token ids, most frequent first, counted over assistant replies of a chat corpus;
it is stored per tokenizer (named by a fingerprint of the tokenizer's vocabulary) in the package (`vocab/`, for the
presets) or in the cache directory (built with `eagle-fsd tune --vocab-from DATA`). Verification stays over the
full vocabulary, so speculative decoding stays lossless; the drafter can just never propose a token outside it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from eagle_fsd.files import cache_dir

PACKAGE_DIR = Path(__file__).with_name("vocab")


def tokenizer_fingerprint(tokenizer) -> str:
    """16 hex digits identifying a tokenizer's token -> id map (models sharing a tokenizer share tables)."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256("\n".join(f"{i}\t{t}" for t, i in items).encode()).hexdigest()[:16]


def _table_paths(fingerprint: str) -> list[Path]:
    return [PACKAGE_DIR / f"{fingerprint}.safetensors", cache_dir() / "vocab" / f"{fingerprint}.safetensors"]


def frequency_order(tokenizer) -> torch.Tensor | None:
    """Token ids, most frequent first, for this tokenizer; None when no table exists for it."""
    from safetensors.torch import load_file

    for path in _table_paths(tokenizer_fingerprint(tokenizer)):
        if path.is_file():
            return load_file(str(path))["order"].long()
    return None


def count_tokens(tokenizer, texts, vocab_size: int, batch: int = 256) -> torch.Tensor:
    """(vocab_size,) occurrence counts of each token id in `texts` (no special tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(0, len(texts), batch):
        for ids in tokenizer(texts[i: i + batch], add_special_tokens=False)["input_ids"]:
            ids = torch.tensor([t for t in ids if t < vocab_size], dtype=torch.long)
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def order_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """Ids by descending count; ties (unseen tokens included) by ascending id, so the table is reproducible."""
    return torch.sort(-counts, stable=True).indices


def save_order(tokenizer, order: torch.Tensor, directory: Path | None = None) -> Path:
    from safetensors.torch import save_file

    directory = directory or cache_dir() / "vocab"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{tokenizer_fingerprint(tokenizer)}.safetensors"
    save_file({"order": order.to(torch.int32).contiguous()}, str(path))
    return path


def draft_vocab(order: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent ids, ascending (the draft lm_head's rows, in vocabulary order)."""
    if not 0 < size <= order.numel():
        raise ValueError(f"draft vocabulary size {size} must be in [1, {order.numel()}]")
    return torch.sort(order[:size]).values


def candidate_sizes(vocab_size: int, cheap_drafter: bool) -> list[int]:
    """Reduced sizes the tuner tries besides the full vocabulary: a quarter (FR-Spec's 32k of 128k) and, for a
    cheap drafter whose lm_head dominates, an eighth; multiples of 1024."""
    sizes = [max(1024, round(vocab_size / 4 / 1024) * 1024)]
    if cheap_drafter:
        sizes.append(max(1024, round(vocab_size / 8 / 1024) * 1024))
    return [s for s in sizes if s < vocab_size]
