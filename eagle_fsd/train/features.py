"""Stage 2, features: the target's last hidden states (after the final norm, what feeds lm_head) for every token,
in safetensors shards `features-<k>.safetensors` (input_ids int32, loss_mask uint8, lengths int64, hidden) each with
a JSON record (fingerprint of its tokens and model, samples, tokens, bytes, sha256, hidden_size, dtype); a shard
whose record is missing or does not match is recomputed.

`target_features` is the one function that says what a feature is; another kind of feature (e.g. several hidden
layers of the target) replaces it and keeps the shard format."""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_fsd.files import atomic_write_text, sha256_file
from eagle_fsd.train.head import CONFIG_KEYS
from eagle_fsd.train.log import log


def model_fingerprint(target) -> str:
    """Identifies a target's weights well enough to tell caches of different models apart."""
    h = hashlib.sha256(json.dumps({k: target.config.to_dict().get(k) for k in CONFIG_KEYS}, default=str).encode())
    for weight in (target.get_input_embeddings().weight, target.get_output_embeddings().weight):
        h.update(weight[:4].detach().float().cpu().numpy().tobytes())
    h.update(str(target.dtype).encode())
    return h.hexdigest()[:16]


def _samples_fingerprint(samples, extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for ids, mask in samples:
        h.update(ids.to(torch.int32).numpy().tobytes())
        h.update(mask.to(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def shard_is_valid(path: Path, fingerprint: str) -> bool:
    """A shard is valid when its record exists, names the same tokens and model, and the file's size and sha256
    match the record (a truncated or altered file fails)."""
    meta_path = path.with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return False
    if meta.get("fingerprint") != fingerprint or not path.is_file():
        return False
    return path.stat().st_size == meta.get("bytes") and sha256_file(path) == meta.get("sha256")


@torch.no_grad()
def target_features(target, samples, batch_tokens: int = 4096, layers: tuple[int, ...] | None = None
                    ) -> list[torch.Tensor]:
    """Last hidden states (after the final norm) of each sample, (L, H) each, in target's dtype; with `layers`
    (EAGLE-3: output_hidden_states indices = the hidden states entering those layers) the rows are
    cat(hidden_states[i] for i in layers, last hidden state), (L, (len(layers) + 1) * H). Batches are right-padded:
    causal attention keeps the padding out of every real position, so no padding mask is needed."""
    decoder, device = target.get_decoder(), target.device
    out: list[torch.Tensor | None] = [None] * len(samples)
    order = sorted(range(len(samples)), key=lambda i: samples[i][0].numel())
    b = 0
    while b < len(order):
        rows = [order[b]]
        while b + len(rows) < len(order) and \
                (len(rows) + 1) * samples[order[b + len(rows)]][0].numel() <= batch_tokens:
            rows.append(order[b + len(rows)])
        b += len(rows)
        width = samples[rows[-1]][0].numel()
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, : samples[i][0].numel()] = samples[i][0]
        result = decoder(input_ids=ids.to(device), use_cache=False, output_hidden_states=layers is not None)
        hidden = result.last_hidden_state
        if layers is not None:
            hidden = torch.cat([result.hidden_states[i] for i in layers] + [hidden], dim=-1)
        for r, i in enumerate(rows):
            out[i] = hidden[r, : samples[i][0].numel()].cpu()
    return out


def build_feature_cache(target, samples, cache_dir: Path, shard_size: int = 256, batch_tokens: int = 4096,
                        dtype: torch.dtype = torch.bfloat16, progress: bool = True,
                        layers: tuple[int, ...] | None = None) -> list[Path]:
    """Feature shards of `samples` ([(ids, mask)]) under cache_dir: shard k holds samples [k*S, (k+1)*S). Valid
    shards are kept; missing, stale or corrupt ones are (re)computed, written to a temp file and renamed."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    cache_dir.mkdir(parents=True, exist_ok=True)
    model_fp = model_fingerprint(target)
    paths = []
    n_shards = math.ceil(len(samples) / shard_size)
    bar = tqdm(total=sum(ids.numel() for ids, _ in samples), desc="features", unit="tok", disable=not progress)
    for k in range(n_shards):
        part = samples[k * shard_size: (k + 1) * shard_size]
        path = cache_dir / f"features-{k:05d}.safetensors"
        fingerprint = _samples_fingerprint(part, f"{model_fp}|{dtype}" + (f"|{list(layers)}" if layers else ""))
        paths.append(path)
        tokens = sum(ids.numel() for ids, _ in part)
        if shard_is_valid(path, fingerprint):
            bar.update(tokens)
            continue
        if path.exists() or path.with_suffix(".json").exists():
            log(f"features: shard {path.name} is stale or corrupt; recomputing it")
        hidden = target_features(target, part, batch_tokens, layers)
        tensors = {
            "input_ids": torch.cat([ids for ids, _ in part]).to(torch.int32),
            "loss_mask": torch.cat([mask for _, mask in part]).to(torch.uint8),
            "lengths": torch.tensor([ids.numel() for ids, _ in part], dtype=torch.int64),
            "hidden": torch.cat(hidden).to(dtype).contiguous(),
        }
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        meta = {"fingerprint": fingerprint, "samples": len(part), "tokens": tokens, "bytes": path.stat().st_size,
                "sha256": sha256_file(path), "hidden_size": tensors["hidden"].shape[1], "dtype": str(dtype)}
        atomic_write_text(path.with_suffix(".json"), json.dumps(meta, indent=1))
        bar.update(tokens)
    bar.close()
    return paths


@dataclass
class Seq:
    ids: torch.Tensor     # (L,) long
    mask: torch.Tensor    # (L,) bool: token is part of an assistant reply
    hidden: torch.Tensor  # (L, H) target features (storage dtype)


def load_shards(paths) -> list[Seq]:
    from safetensors.torch import load_file

    seqs = []
    for path in paths:
        t = load_file(str(path))  # memory-mapped: copy, so later writes to the file cannot reach the tensors
        ids, mask, hidden = t["input_ids"].long(), t["loss_mask"].bool(), t["hidden"].clone()
        lengths = t["lengths"].tolist()
        if sum(lengths) != ids.numel() or hidden.shape[0] != ids.numel():
            raise ValueError(f"feature shard {path} is inconsistent; delete it to have it recomputed")
        for a, n in zip([0] + list(torch.tensor(lengths).cumsum(0)[:-1].tolist()), lengths):
            seqs.append(Seq(ids[a:a + n], mask[a:a + n], hidden[a:a + n]))
    return seqs
