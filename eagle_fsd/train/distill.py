"""Self-distillation: the target regenerates the assistant turns greedily (its own replies are what the head must
predict), many prompts at once; the replies go to a jsonl as they come, which a rerun reuses.

The jsonl is `distill-<key>.jsonl` (key: `distill_path`), one `{"index": i, "messages": [...]}` record per line."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_fsd.hf import cache_kwargs
from eagle_fsd.model import eos_token_ids
from eagle_fsd.train.data import iter_json_records, mostly_ascii, prompt_ids


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


def distill_path(cache: Path, data: str, seed: int, model_fp: str, gen_tokens: int, turns: int,
                 max_prompt_tokens: int, min_ascii: float) -> Path:
    """The jsonl of one self-distillation, named by what its replies depend on (data, seed, model, generation
    settings), so that a rerun with the same settings finds and reuses it."""
    key = hashlib.sha256(json.dumps([data, seed, model_fp, gen_tokens, turns, max_prompt_tokens, min_ascii]).encode())
    return cache / f"distill-{key.hexdigest()[:12]}.jsonl"


@dataclass(frozen=True)
class DistillSettings:
    """Which conversations are regenerated and how: the first `turns` assistant turns of those whose first prompt
    has at most max_prompt_tokens tokens and that pass the min_ascii filter; replies of at most max_new_tokens,
    batch_size prompts at a time."""
    max_new_tokens: int = 256
    batch_size: int = 16
    turns: int = 1
    max_prompt_tokens: int = 512
    min_ascii: float = 0.0


def self_distill(target, tokenizer, convs, n: int, path: Path, settings: DistillSettings = DistillSettings(),
                 progress: bool = True):
    """(distilled, rest): the first n conversations (in order) whose first prompt fits, with their first `turns`
    assistant turns regenerated by the target (greedy) and the rest of each conversation dropped; and the
    conversations after the last one chosen (as they are), that pass the min_ascii filter. Replies are appended to
    `path` (jsonl) as they come; records already there are reused, so an interrupted run resumes."""
    chosen, stop = choose_conversations(tokenizer, convs, n, settings.turns, settings.max_prompt_tokens,
                                        settings.min_ascii)
    done = read_distilled(path, n, len(chosen))
    meter = Progress(progress)
    with open(path, "a") as out:
        for turn in range(settings.turns):
            distill_turn(target, tokenizer, chosen, done, turn, out, settings, meter)
    distilled = [done[i] for i in sorted(done) if done[i][-1]["role"] == "assistant"]
    return distilled, [conv for conv in convs[stop:] if mostly_ascii(conv, settings.min_ascii)]


def choose_conversations(tokenizer, convs, n: int, turns: int, max_prompt_tokens: int, min_ascii: float):
    """([(system prefix, first `turns` user turns)] of the first n usable conversations, index after the last one
    looked at): a conversation is usable when it passes the min_ascii filter and its first prompt fits."""
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
        if len(prompt_ids(tokenizer, prefix + user_turns[:1])) > max_prompt_tokens:
            continue
        chosen.append((prefix, user_turns))
    return chosen, stop


def read_distilled(path: Path, n: int, n_chosen: int) -> dict[int, list[dict]]:
    """index -> messages regenerated so far, from the records of an earlier (maybe interrupted) run."""
    done: dict[int, list[dict]] = {}
    if path.is_file():
        for record in iter_json_records(path):
            if isinstance(record, dict) and record.get("index", n) < n_chosen:
                done[record["index"]] = record["messages"]
    return done


@dataclass
class Progress:
    """A progress bar per turn (when shown) and the rate of new tokens since construction."""
    shown: bool = True
    start: float = field(default_factory=time.perf_counter)
    tokens: int = 0

    def bar(self, total: int, turn: int):
        from tqdm import tqdm

        return tqdm(total=total, desc=f"self-distill turn {turn + 1}", disable=not self.shown, unit="conv")

    def add(self, tokens: int) -> str:
        self.tokens += tokens
        return f"{self.tokens / (time.perf_counter() - self.start):.0f}"


def distill_turn(target, tokenizer, chosen, done: dict[int, list[dict]], turn: int, out, settings: DistillSettings,
                 progress: Progress) -> None:
    """Regenerate assistant turn `turn` of every chosen conversation that lacks it; each reply is added to `done` and
    appended to `out` as one {"index", "messages"} record."""
    todo = [i for i, (prefix, users) in enumerate(chosen) if len(users) > turn
            and sum(m["role"] == "assistant" for m in done.get(i, [])) <= turn]
    if not todo:
        return
    prompts = []
    for i in todo:
        prefix, users = chosen[i]
        prompts.append(prompt_ids(tokenizer, done.get(i, prefix) + [users[turn]]))
    bar = progress.bar(len(todo), turn)
    for j, reply, _ in generate_replies(target, tokenizer, prompts, settings.max_new_tokens, settings.batch_size):
        i = todo[j]
        prefix, users = chosen[i]
        messages = done.get(i, prefix) + [users[turn], {"role": "assistant", "content":
                                                         tokenizer.decode(reply, skip_special_tokens=True)}]
        done[i] = messages
        out.write(json.dumps({"index": i, "messages": messages}) + "\n")
        out.flush()
        bar.update(1)
        bar.set_postfix(tok_s=progress.add(len(reply)))
    bar.close()
