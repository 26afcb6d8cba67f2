"""`eagle-fsd train-head`: arguments, then the stages in order (data, features, training), each a function."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_fsd.dtypes import DTYPES
from eagle_fsd.drafting.eagle3 import default_aux_indices
from eagle_fsd.eagle3_export import save_eagle3_head
from eagle_fsd.files import atomic_write_text, sha256_file
from eagle_fsd.train.data import encode_all, ensure_chat_template, load_conversations, mostly_ascii
from eagle_fsd.train.distill import DistillSettings, distill_path, self_distill
from eagle_fsd.train.eagle3 import Eagle3Loss, draft_vocabulary, new_eagle3_head
from eagle_fsd.train.features import build_feature_cache, load_shards, model_fingerprint
from eagle_fsd.train.head import head_raw_config, new_head, save_head
from eagle_fsd.train.log import log
from eagle_fsd.train.loop import TrainConfig, train
from eagle_fsd.train.loss import LossSettings, head_loss


def _cpu_bf16_fast() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def add_training_args(p: argparse.ArgumentParser) -> None:
    """Optimisation, loss, storage and run-control flags."""
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


def parse_args(argv):
    p = argparse.ArgumentParser(prog="eagle-fsd train-head", description="train an EAGLE head for a causal LM")
    p.add_argument("--base", required=True, help="target model: preset name, hub id or directory")
    p.add_argument("--arch", choices=["eagle2", "eagle3"], default="eagle2",
                   help="eagle2: EAGLE-1/2 head (fc over [embedding, last hidden]); eagle3: EAGLE-3 head (three "
                        "target layers, own lm_head over a draft vocabulary, training-time test)")
    p.add_argument("--draft-vocab", type=int, default=32000,
                   help="eagle3: draft vocabulary size, the most frequent reply tokens (capped at the vocabulary)")
    p.add_argument("--ttt-steps", type=int, default=7, help="eagle3: training-time-test unroll steps")
    p.add_argument("--export", choices=["eagle", "sglang", "speculators"], default="eagle",
                   help="eagle3: checkpoint layout written (SafeAILab EAGLE, SGLang/SpecForge, vLLM speculators)")
    p.add_argument("--verifier", default=None, metavar="NAME",
                   help="--export speculators: the target vLLM loads when it serves the head's folder (default: a "
                        "preset's hub id, a hub id as given, a directory's absolute path)")
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
    add_training_args(p)
    return p.parse_args(argv)


@dataclass
class Run:
    """What every stage reads: the arguments, where things go, the frozen target, and the stage times."""
    args: argparse.Namespace
    device: torch.device
    bf16: bool  # bf16 autocast for training
    out: Path
    cache: Path
    target: object
    tokenizer: object
    start: float = field(default_factory=time.perf_counter)
    times: dict[str, float] = field(default_factory=dict)

    @property
    def progress(self) -> bool:
        return not self.args.no_progress


def train_dtypes(args, device: torch.device) -> tuple[torch.dtype, bool]:
    """(target dtype, bf16 autocast for training): auto is fp32 on CPU and bf16 on GPU for the target, and bf16
    autocast on a GPU or a CPU with native bf16."""
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    bf16 = args.train_precision == "bf16" or (args.train_precision == "auto" and (
        (device.type == "cuda" and torch.cuda.is_bf16_supported()) or (device.type == "cpu" and _cpu_bf16_fast())))
    return dtype, bf16


def setup(args) -> Run:
    """Threads, device and dtypes; the cache folder; the target (frozen) and its tokenizer (with a chat template)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_fsd import presets

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype, bf16 = train_dtypes(args, device)
    out = Path(args.out)
    cache = Path(args.cache_dir) if args.cache_dir else out / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    path = presets.resolve_model(args.base)
    log(f"target {args.base} ({path}), {dtype}, device {device}, threads {torch.get_num_threads()}")
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ensure_chat_template(tokenizer)
    for param in target.parameters():
        param.requires_grad_(False)
    return Run(args, device, bf16, out, cache, target, tokenizer, start=start)


def data_stage(run: Run) -> list:
    """[(ids, mask)]: the conversations (self-distilled ones first when asked for), encoded up to --max-tokens."""
    args = run.args
    convs = load_conversations(args.data, args.seed)
    if args.self_distill:
        path = distill_path(run.cache, args.data, args.seed, model_fingerprint(run.target), args.gen_tokens,
                            args.distill_turns, args.max_prompt_tokens, args.min_ascii)
        settings = DistillSettings(args.gen_tokens, args.gen_batch, args.distill_turns, args.max_prompt_tokens,
                                   args.min_ascii)
        distilled, rest = self_distill(run.target, run.tokenizer, convs, args.self_distill, path, settings,
                                       run.progress)
        log(f"data: {len(distilled)} self-distilled conversations in {path}")
        # --max-tokens beyond the distilled data: fill up with conversations that keep the dataset's replies
        convs = distilled + (rest if args.max_tokens else [])
    else:
        convs = [conv for conv in convs if mostly_ascii(conv, args.min_ascii)]
    samples = encode_all(run.tokenizer, convs, args.max_len, args.max_tokens)
    n_tokens = sum(ids.numel() for ids, _ in samples)
    n_loss = sum(int(mask.sum()) for _, mask in samples)
    log(f"data: {len(samples)} conversations, {n_tokens} tokens ({n_loss} assistant tokens)")
    run.times["data_s"] = time.perf_counter() - run.start
    return samples


def features_stage(run: Run, samples) -> list[Path]:
    started = time.perf_counter()
    args = run.args
    layers = default_aux_indices(run.target.config.num_hidden_layers) if args.arch == "eagle3" else None
    paths = build_feature_cache(run.target, samples, run.cache, args.shard_size, args.batch_tokens,
                                DTYPES[args.feature_dtype], run.progress, layers)
    run.times["features_s"] = time.perf_counter() - started
    log(f"features: {len(paths)} shards in {run.cache} ({run.times['features_s']:.0f} s)")
    return paths


def split_held_out(seqs: list, holdout: float) -> tuple[list, list]:
    """(held out, training): the first sequences (already in shuffled order), a fraction if < 1, else a count."""
    n_held = int(holdout) if holdout >= 1 else max(1, int(round(holdout * len(seqs))))
    n_held = min(n_held, len(seqs) - 1) if holdout > 0 else 0
    return seqs[:n_held], seqs[n_held:]


def initial_head(run: Run, samples):
    """(head, raw config or None, loss function): new or --init, EAGLE-1/2 or EAGLE-3."""
    from eagle_fsd.drafting import load_eagle_head
    from eagle_fsd.drafting.eagle3 import load_eagle3_head

    args = run.args
    if args.arch == "eagle3":
        draft_ids = draft_vocabulary(samples, run.target.config.vocab_size, args.draft_vocab)
        head = new_eagle3_head(run.target, draft_ids, args.seed)
        if args.init:
            head.load_state_dict(load_eagle3_head(args.init, run.target)[0].float().state_dict())
        log(f"train: EAGLE-3 head, draft vocabulary {draft_ids.numel()}, {args.ttt_steps} TTT steps")
        return head, None, Eagle3Loss(args.ttt_steps)
    raw = head_raw_config(run.target.config)
    head = new_head(raw, args.seed)
    if args.init:
        head.load_state_dict(load_eagle_head(args.init, run.target).state_dict())
    return head, raw, head_loss


def training_stage(run: Run, paths: list[Path], samples):
    """(head, its raw config, train()'s summary, held-out count, training count)."""
    args = run.args
    started = time.perf_counter()
    held, train_seqs = split_held_out(load_shards(paths), args.holdout)
    log(f"train: {len(train_seqs)} conversations for training, {len(held)} held out; bf16 autocast {run.bf16}")
    head, raw, loss_fn = initial_head(run, samples)
    if args.init:
        log(f"train: starting from the head in {args.init}")
    config = TrainConfig(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, batch_tokens=args.batch_tokens,
                         warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                         loss=LossSettings(args.noise, args.v_weight, args.p_weight), seed=args.seed, bf16=run.bf16,
                         resume=args.resume, save_every=args.save_every, eval_every=args.eval_every,
                         progress=run.progress)
    summary = train(head, run.target, train_seqs, held, config, state_path=run.cache / "train_state.pt",
                    loss_fn=loss_fn)
    run.times["train_s"] = time.perf_counter() - started
    return head, raw, summary, len(held), len(train_seqs)


def save_and_report(run: Run, argv: list[str], samples, head, raw: dict, summary: dict, n_held: int,
                    n_train: int) -> None:
    """Save the head (it must load against its target) and write cache/train_report.json."""
    from eagle_fsd.drafting import load_eagle_head
    from eagle_fsd.drafting.eagle3 import load_eagle3_head

    if raw is None:  # EAGLE-3
        from eagle_fsd.presets import serving_name

        save_eagle3_head(head.cast(DTYPES[run.args.save_dtype]), str(run.out), run.args.export, run.target.config,
                         run.args.verifier or serving_name(run.args.base))
        digest = sha256_file(run.out / "model.safetensors")
        load_eagle3_head(str(run.out), run.target)
    else:
        digest = save_head(head, raw, run.out, DTYPES[run.args.save_dtype])
        load_eagle_head(str(run.out), run.target)
    run.times["total_s"] = time.perf_counter() - run.start
    report = {"argv": argv, "base": run.args.base, "conversations": len(samples),
              "tokens": sum(ids.numel() for ids, _ in samples),
              "assistant_tokens": sum(int(mask.sum()) for _, mask in samples), "train_conversations": n_train,
              "held_out_conversations": n_held, "steps": summary["steps"], "held_out": summary["held"],
              "sha256": digest, "times": run.times, "history": summary["history"]}
    path = run.cache / "train_report.json"
    atomic_write_text(path, json.dumps(report, indent=1))
    log(f"saved {run.out}/config.json + model.safetensors (sha256 {digest}); held-out top-1 "
        f"{summary['held'].get('top1', float('nan')):.4f}; wall time {run.times['total_s']:.0f} s; report in {path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    run = setup(parse_args(argv))
    samples = data_stage(run)
    if run.args.stop_after == "data":
        return 0
    paths = features_stage(run, samples)
    if run.args.stop_after == "features":
        return 0
    head, raw, summary, n_held, n_train = training_stage(run, paths, samples)
    save_and_report(run, argv, samples, head, raw, summary, n_held, n_train)
    return 0
