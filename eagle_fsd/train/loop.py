"""Stage 3, training (EAGLE-1/2 recipe, eagle2.md section 6.3): AdamW, gradient clipping, linear warm-up then
cosine decay, held-out top-1 agreement with the target's argmax, a checkpointed training state that --resume
continues from."""
from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_fsd.drafting import EagleHead
from eagle_fsd.train.features import Seq
from eagle_fsd.train.log import log
from eagle_fsd.train.loss import LossSettings, head_loss


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


@torch.no_grad()
def evaluate(head, embed, lm_head, seqs: list[Seq], device, batch_tokens: int = 4096, loss_fn=None) -> dict:
    """Held-out metrics without noise, in fp32: top-1 agreement with the target's argmax and both losses."""
    was_training = head.training
    head.eval()
    correct = count = 0
    v = p = 0.0
    loss_fn = loss_fn or head_loss
    by_step: list[list[int]] = []
    for batch in make_batches([s.ids.numel() for s in seqs], 64, batch_tokens, random.Random(0)):
        parts = loss_fn(head, embed, lm_head, *collate([seqs[i] for i in batch], device))
        correct, count = correct + parts.correct, count + parts.count
        v, p = v + parts.v_loss * parts.count, p + parts.p_loss * parts.count
        for j, (c, n) in enumerate(parts.by_step or []):
            if j == len(by_step):
                by_step.append([0, 0])
            by_step[j][0] += c
            by_step[j][1] += n
    head.train(was_training)
    metrics = {"top1": correct / max(count, 1), "v_loss": v / max(count, 1), "p_loss": p / max(count, 1),
               "positions": count}
    if by_step:  # agreement with the target's argmax at each unroll step (draft depth 1, 2, ...)
        metrics["top1_by_step"] = [round(c / max(n, 1), 4) for c, n in by_step]
    return metrics


def lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(total - warmup, 1))))


def plan_steps(lengths: list[int], epochs: float, batch_size: int, batch_tokens: int, seed: int):
    """(batches of each epoch, [(epoch, batch)] of every step): ceil(epochs) shuffled epochs, the last one cut short
    when epochs is fractional."""
    epoch_batches = [make_batches(lengths, batch_size, batch_tokens, random.Random(seed * 1000 + e))
                     for e in range(math.ceil(epochs))]
    plan = [(e, b) for e in range(len(epoch_batches)) for b in range(len(epoch_batches[e]))]
    total = max(1, int(round(epochs / math.ceil(epochs) * len(plan)))) if plan else 0
    return epoch_batches, plan[:total]


def load_state(state_path: Path, total: int, head, opt, sched) -> tuple[int, list]:
    """Restore head, optimizer and schedule from a checkpoint of a run of the same length; (step, history)."""
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    if state.get("total") != total:
        raise ValueError(f"{state_path} was saved for a run of {state.get('total')} steps, this run has {total}; "
                         "rerun with the same data and settings, or without --resume")
    head.load_state_dict(state["head"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    log(f"train: resumed at step {state['step']}/{total} from {state_path}")
    return state["step"], state.get("history", [])


def save_state(state_path: Path | None, head, opt, sched, step: int, total: int, history: list) -> None:
    if state_path is None:
        return
    tmp = state_path.with_name(state_path.name + ".tmp")
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step,
                "total": total, "history": history}, tmp)
    os.replace(tmp, state_path)


@dataclass
class Running:
    """Exponential moving averages (weight 0.05) of the training loss and top-1, and the token rate."""
    loss: float | None = None
    top1: float | None = None
    tokens: int = 0
    start: float = 0.0

    def add(self, parts, tokens: int) -> None:
        loss, acc = parts.loss.item(), parts.correct / max(parts.count, 1)
        self.loss = loss if self.loss is None else 0.95 * self.loss + 0.05 * loss
        self.top1 = acc if self.top1 is None else 0.95 * self.top1 + 0.05 * acc
        self.tokens += tokens

    def postfix(self, held: dict) -> dict:
        return dict(loss=f"{self.loss:.3f}", top1=f"{self.top1:.3f}", held=f"{held.get('top1', float('nan')):.3f}",
                    tok_s=f"{self.tokens / (time.perf_counter() - self.start):.0f}")


def log_eval(step: int, total: int, epoch: int, running: Running, held: dict) -> None:
    nan = float("nan")
    log(f"train: step {step}/{total} epoch {epoch + 1} loss {running.loss:.4f} train top-1 {running.top1:.3f} "
        f"held-out top-1 {held.get('top1', nan):.4f} (v {held.get('v_loss', nan):.4f}, "
        f"p {held.get('p_loss', nan):.3f})")


def optimizer_step(head, opt, sched, loss: torch.Tensor, grad_clip: float) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_value_(head.parameters(), grad_clip)
    opt.step()
    sched.step()


@dataclass(frozen=True)
class TrainConfig:
    """AdamW (betas 0.9, 0.95) at peak rate lr, warmed up linearly over a `warmup` fraction of the steps, then cosine
    decay; gradients clipped by value at grad_clip (0: off). Batches of at most batch_size sequences and batch_tokens
    padded tokens; epochs may be fractional (the last epoch is cut short). bf16: autocast. Held-out evaluation every
    eval_every steps and a checkpoint every save_every steps (0: only at the end); resume continues from one."""
    epochs: float = 2.0
    lr: float = 3e-4
    batch_size: int = 8
    batch_tokens: int = 4096
    warmup: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    loss: LossSettings = LossSettings(noise=0.2)  # feature noise and loss weights of head_loss
    seed: int = 0
    bf16: bool = False
    resume: bool = False
    save_every: int = 200
    eval_every: int = 200
    progress: bool = True


def optimizer(head, config: TrainConfig, total: int):
    """(AdamW, its warm-up then cosine schedule over `total` steps)."""
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    warm = max(1, int(config.warmup * total))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, warm))


def train(head: EagleHead, target, train_seqs: list[Seq], held_seqs: list[Seq], config: TrainConfig = TrainConfig(),
          *, state_path: Path | None = None, loss_fn=None) -> dict:
    """Train `head` in place on the feature sequences; returns a summary (held-out metrics, steps, times).
    state_path: the training state's checkpoint (None: none). loss_fn: head_loss (EAGLE-1/2) or one with its
    signature (train.eagle3.Eagle3Loss); None: head_loss."""
    from tqdm import tqdm

    device = target.device
    loss_fn = loss_fn or head_loss
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    for param in target.parameters():
        param.requires_grad_(False)
    head.to(device).train()
    epoch_batches, plan = plan_steps([s.ids.numel() for s in train_seqs], config.epochs, config.batch_size,
                                     config.batch_tokens, config.seed)
    total = len(plan)
    opt, sched = optimizer(head, config, total)
    step, history = 0, []
    if config.resume and state_path is not None and state_path.is_file():
        step, history = load_state(state_path, total, head, opt, sched)
    generator = torch.Generator(device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16)
    held = history[-1]["held"] if history else {}
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=not config.progress)
    running = Running(start=time.perf_counter())
    while step < total:
        e, b = plan[step]
        ids, mask, hidden = collate([train_seqs[i] for i in epoch_batches[e][b]], device)
        generator.manual_seed(config.seed * 1_000_003 + step)
        with autocast:
            parts = loss_fn(head, embed, lm_head, ids, mask, hidden, config.loss, generator)
        optimizer_step(head, opt, sched, parts.loss, config.grad_clip)
        step += 1
        running.add(parts, ids.numel())
        if (config.eval_every and step % config.eval_every == 0) or step == total:
            held = evaluate(head, embed, lm_head, held_seqs, device, config.batch_tokens, loss_fn) if held_seqs else {}
            history.append({"step": step, "epoch": e, "loss": running.loss, "train_top1": running.top1,
                            "held": held, "lr": sched.get_last_lr()[0]})
            log_eval(step, total, e, running, held)
        if (config.save_every and step % config.save_every == 0) or step == total:
            save_state(state_path, head, opt, sched, step, total, history)
        bar.update(1)
        bar.set_postfix(**running.postfix(held))
    bar.close()
    head.eval()
    return {"steps": total, "held": held, "history": history}
