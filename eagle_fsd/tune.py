"""Speculation that pays on this machine: a measured cost model and the draft tree it chooses.

One speculative step emits E[a + 1] tokens (a = accepted draft tokens, +1 for the target's own token) and costs

    t_step(n, d, k, v) = t_verify(n) + d * t_level(k, v) + t_extend(v) + t_overhead

for a tree of n nodes grown by d draft forwards of k nodes each (EAGLE's total_token, depth, top_k), the drafter
scoring a draft vocabulary of the v most frequent tokens (v = 0: the whole vocabulary). Plain decoding emits one
token per t_plain. So the predicted speedup of a shape is

    speedup(n, d, k, v) = E[a + 1 | n, d, k, v] * t_plain / t_step(n, d, k, v)

`measure` times every term on this machine (target forwards over n new tokens, draft forwards over k nodes, the
drafter's catch-up, the engine's own per-step cost and plain decoding, all through the real engine) and measures
E[a + 1 | shape] by replay: the target's greedy continuation of shipped calibration prompts is decoded once, then
at every position the drafter grows its pool as in a real step and the accepted length of every candidate tree is
read off it (for greedy decoding the accepted path is the longest prefix of that continuation the tree holds, so
the replay is exact, and one pool per top_k serves every depth and size). `choose_shape` takes the argmax; when it
is below 1 the engine decodes plainly. Profiles are cached as JSON per model, drafter, device, dtype and threads.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle_fsd.cache import TreeCache
from eagle_fsd.hf import causal_mask, decoder_forward
from eagle_fsd.tree.dynamic import grow_pool

TUNE_VERSION = 2
SIZES = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)  # candidate total_token (tree nodes, root included)
TOP_KS = (1, 2, 4, 8)
MAX_DEPTH = 6
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


# ---------------------------------------------------------------- the cost model (pure)
@dataclass
class CostProfile:
    """Measured costs (milliseconds) and acceptance. Keys of the dicts are ints (tree size, width) or shapes."""

    verify_ms: dict[int, float]                 # target forward + lm_head over n new tokens atop a cache
    level_ms: dict[tuple[int, int], float]      # (k, v): one draft forward over k tree nodes (+ its lm_head)
    extend_ms: dict[int, float]                 # v: the drafter's catch-up over a step's accepted tokens
    overhead_ms: float                          # the engine's own work per speculative step (tree, accept, cache)
    plain_ms: float                             # one token of plain decoding through the same loop
    tau: dict[tuple[int, int, int, int], float]  # (n, d, k, v) -> E[a + 1], from the replay
    acceptance_by_depth: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (k, v) -> P(d | d-1)
    rank_histogram: list[float] = field(default_factory=list)  # P(target's token is the drafter's r-th choice)

    def step_ms(self, shape: tuple[int, int, int, int]) -> float:
        n, d, k, v = shape
        return self.verify_ms[n] + d * self.level_ms[(k, v)] + self.extend_ms[v] + self.overhead_ms

    def speedup(self, shape: tuple[int, int, int, int]) -> float:
        return self.tau[shape] * self.plain_ms / self.step_ms(shape)

    def to_json(self) -> dict:
        def keyed(d):
            return {",".join(map(str, k)) if isinstance(k, tuple) else str(k): v for k, v in d.items()}

        out = asdict(self)
        for name in ("verify_ms", "level_ms", "extend_ms", "tau", "acceptance_by_depth"):
            out[name] = keyed(getattr(self, name))
        return out

    @classmethod
    def from_json(cls, raw: dict) -> "CostProfile":
        def unkeyed(d):
            return {tuple(int(x) for x in k.split(",")) if "," in k else int(k): v for k, v in d.items()}

        raw = dict(raw)
        for name in ("verify_ms", "level_ms", "extend_ms", "tau", "acceptance_by_depth"):
            raw[name] = unkeyed(raw.get(name, {}))
        return cls(**raw)


def choose_shape(profile: CostProfile, total_token: int | None = None, depth: int | None = None,
                 top_k: int | None = None) -> tuple[tuple[int, int, int, int], float]:
    """The shape (n, d, k, v) with the highest predicted speedup (ties: the smaller tree), among those matching the
    fixed values given. Returns (shape, predicted speedup)."""
    candidates = [s for s in profile.tau
                  if (total_token is None or s[0] == total_token) and (depth is None or s[1] == depth)
                  and (top_k is None or s[2] == top_k) and s[0] in profile.verify_ms
                  and (s[2], s[3]) in profile.level_ms and s[3] in profile.extend_ms]
    if not candidates:
        raise ValueError(f"no measured tree shape has total_token={total_token}, depth={depth}, top_k={top_k}; "
                         f"measured sizes {sorted(profile.verify_ms)}, top_k {sorted({k for k, _ in profile.level_ms})}, "
                         f"depth 1..{max(s[1] for s in profile.tau)}: pick from those or re-run `eagle-fsd tune`")
    best = max(candidates, key=lambda s: (profile.speedup(s), -s[0], -s[1], -s[2], s[3]))
    return best, profile.speedup(best)


@dataclass
class Tuning:
    """What the engine uses: the chosen shape, whether to speculate at all, and the plain rate for the guard."""

    shape: tuple[int, int, int, int]      # total_token, depth, top_k, draft vocabulary size (0: full)
    predicted_speedup: float
    plain_ms: float                        # the profile's t_plain and t_verify(n): the speed guard's yardstick
    verify_ms: dict[int, float]
    speculate: bool
    path: str = ""


def tuning_from(profile: CostProfile, fixed: dict, path: str = "") -> Tuning:
    shape, speedup = choose_shape(profile, **fixed)
    return Tuning(tuple(shape), speedup, profile.plain_ms, dict(profile.verify_ms), speculate=speedup > 1.0,
                  path=path)


# ---------------------------------------------------------------- replay: E[a + 1] for every shape
def accepted_path(pool, continuation: list[int]) -> list[int]:
    """Pool indices (1-based) of the pool nodes on the continuation: level L's node holds continuation[L - 1]."""
    tokens, parents, depths = pool.tokens.tolist(), pool.parents.tolist(), pool.depths.tolist()
    path, parent = [], 0
    for i, (tok, par, dep) in enumerate(zip(tokens, parents, depths)):
        level = len(path) + 1
        if dep == level and par == parent and level <= len(continuation) and tok == continuation[level - 1]:
            path.append(i + 1)
            parent = i + 1
    return path


def accepted_lengths(pool, continuation: list[int], sizes, depths) -> dict[tuple[int, int], int]:
    """(n, d) -> accepted length of the tree of n nodes selected from the first d + 1 pool levels (select_tree's
    stable rerank: a node's rank counts the nodes scoring higher, and equal ones drafted earlier)."""
    path = accepted_path(pool, continuation)
    scores, node_depth = pool.scores, pool.depths
    out = {}
    for d in depths:
        within = node_depth <= d + 1
        ranks = []
        for p in path[: d + 1]:
            s = scores[p - 1]
            earlier = torch.arange(scores.numel()) < p - 1
            ranks.append(int((within & ((scores > s) | ((scores == s) & earlier))).sum()))
        for n in sizes:
            # ranks grow along the path (a child never scores above its parent), so count the prefix that fits
            out[(n, d)] = sum(1 for r in ranks if r < n - 1)
    return out


def walk_tau(lengths: list[dict], key) -> float:
    """Tokens per step when decoding steps start at 0, then after each step's a + 1 tokens."""
    j = steps = tokens = 0
    while j < len(lengths):
        a = lengths[j][key]
        steps, tokens, j = steps + 1, tokens + a + 1, j + a + 1
    return tokens / max(steps, 1)


# ---------------------------------------------------------------- measurement
def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_rounds(fns: dict, rounds: int, before=None) -> dict:
    """Median ms of each fn, measured round-robin (every round times each fn once), so that slow drift of a
    shared machine hits all of them alike. `before` runs untimed ahead of each call (e.g. evicting caches)."""
    times = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            if before is not None:
                before()
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            times[key].append((time.perf_counter() - start) * 1000)
    return {key: statistics.median(t) for key, t in times.items()}


def calibration_prompts(tokenizer, count: int, texts=None) -> list[torch.Tensor]:
    """The first `count` prompts (the shipped calibration prompts unless `texts`), through the chat template."""
    texts = list(texts or json.loads(CALIBRATION_FILE.read_text())["prompts"])[:count]
    if getattr(tokenizer, "chat_template", None):
        return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"] for t in texts]
    return [tokenizer(t, return_tensors="pt")["input_ids"] for t in texts]


def _target_hidden(target, ids: torch.Tensor) -> torch.Tensor:
    device = target.device
    cache = TreeCache(target.config.num_hidden_layers, ids.numel())
    return decoder_forward(target, ids, cache, causal_mask(0, ids.numel(), device),
                           torch.arange(ids.numel(), device=device))


class DraftSetup:
    """A drafter primed on a context, to time its forwards as the engine runs them."""

    def __init__(self, drafter, context: torch.Tensor, target_hidden: torch.Tensor, room: int):
        self.drafter = drafter
        drafter.reset(context.numel() + room)
        self.logits, self.state = drafter.prefill(context[:-1], context[-1], target_hidden[:-1])
        self.length = drafter.length
        self.tokens, self.hidden = context[-3:], target_hidden[-3:]

    def level(self, k: int) -> None:
        """Level 0 of a tree: the root's top-k children, one draft forward."""
        d = self.drafter
        tokens = self.logits.topk(k).indices
        tokens = tokens if d.draft_vocab is None else d.draft_vocab[tokens]
        states = None if self.state is None else self.state[None].expand(k, -1)
        d.forward_level(tokens, states, 0, torch.eye(k, dtype=torch.bool, device=tokens.device))
        d.rollback()

    def extend(self) -> None:
        """A catch-up over three accepted tokens, then back."""
        d = self.drafter
        d.extend(self.tokens, self.hidden)
        d.cache.crop(self.length)
        d.length = self.length


def measure_costs(model, context: torch.Tensor, sizes, top_ks, vocabs: dict, rounds: int):
    """verify_ms per tree size, level_ms per (k, v), extend_ms per v; draft forwards run between the timed
    target forwards, as in the engine (they evict the target's weights from the caches)."""
    target, drafter = model.base_model, model.drafter
    device = target.device
    ctx = context.to(device)
    hidden = _target_hidden(target, ctx)
    cache = TreeCache(target.config.num_hidden_layers, ctx.numel() + max(sizes))
    decoder_forward(target, ctx, cache, causal_mask(0, ctx.numel(), device), torch.arange(ctx.numel(), device=device))
    base = ctx.numel()
    new = ctx[-1:].repeat(max(sizes))
    lm_head = target.get_output_embeddings()

    def verify(n):
        h = decoder_forward(target, new[:n], cache, causal_mask(base, n, device), base + torch.arange(n, device=device))
        lm_head(h)
        cache.crop(base)

    setup = DraftSetup(drafter, ctx, hidden, room=16 + 2 * max(top_ks))
    verify(1)
    verify_ms = _timed_rounds({n: (lambda n=n: verify(n)) for n in sizes}, rounds, before=lambda: setup.level(1))
    level_ms, extend_ms = {}, {}
    for v, ids in vocabs.items():
        drafter.draft_head.set_draft_vocab(ids)
        setup = DraftSetup(drafter, ctx, hidden, room=16 + 2 * max(top_ks))
        fns = {("level", k): (lambda k=k: setup.level(k)) for k in top_ks}
        fns["extend"] = setup.extend
        setup.level(1)
        timed = _timed_rounds(fns, rounds, before=lambda: verify(1))
        extend_ms[v] = timed.pop("extend")
        level_ms.update({(k, v): t for (_, k), t in timed.items()})
    drafter.draft_head.set_draft_vocab(None)
    return verify_ms, level_ms, extend_ms


def replay(model, prompt: torch.Tensor, continuation: torch.Tensor, top_ks, max_depth: int, sizes, progress=None):
    """Per position j of the target's greedy continuation: {(n, d, k): accepted length} of the tree a step rooted
    at continuation[j] would verify, and the rank of continuation[j + 1] among the drafter's choices at the root."""
    target, drafter = model.base_model, model.drafter
    device = target.device
    full = torch.cat([prompt, continuation]).to(device)
    p = prompt.numel()
    hidden = _target_hidden(target, full)
    drafter.reset(full.numel() + 2 + max_depth * max(top_ks) + max(top_ks))
    root_logits, root_state = drafter.prefill(full[:p], full[p], hidden[:p])
    g = continuation.tolist()
    rows, ranks = [], []
    for j in range(len(g) - max_depth - 1):
        ahead = g[j + 1: j + max_depth + 2]
        lengths = {}
        for k in top_ks:
            pool = grow_pool(drafter.forward_level, root_logits, root_state, max_depth, k, drafter.draft_vocab)
            drafter.rollback()
            for (n, d), a in accepted_lengths(pool, ahead, sizes, range(1, max_depth + 1)).items():
                if n - 1 <= k + d * k * k:  # a tree no bigger than the pool that d draft forwards grow
                    lengths[(n, d, k)] = a
        rows.append(lengths)
        order = root_logits.topk(8).indices
        vocab = drafter.draft_vocab
        order = order if vocab is None else vocab[order]
        hit = (order == ahead[0]).nonzero()
        ranks.append(int(hit[0, 0]) if hit.numel() else 8)
        root_logits, root_state = drafter.extend(full[p + j + 1: p + j + 2], hidden[p + j: p + j + 1])
        if progress is not None:
            progress.update(1)
    return rows, ranks


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass
class TuneSettings:
    """How much the tuner measures. Up to prompts x new_tokens calibration positions (fewer for an expensive
    drafter, to keep the replay near replay_seconds); top_ks / max_depth / sizes bound the shapes tried (top_ks
    None: chosen from the drafter's cost); vocabs None: the full vocabulary plus the reduced sizes of
    vocab.candidate_sizes when a frequency table exists for the tokenizer; rounds: timing repeats."""

    prompts: int = 6
    new_tokens: int = 64
    top_ks: tuple[int, ...] | None = None
    max_depth: int = MAX_DEPTH
    sizes: tuple[int, ...] = SIZES
    vocabs: tuple[int, ...] | None = None
    rounds: int = 5
    replay_seconds: float = 45.0
    prompt_texts: tuple[str, ...] | None = None  # None: the shipped calibration prompts


def measure(model, settings: TuneSettings | None = None, progress: bool = True) -> CostProfile:
    """Measure a CostProfile for `model` (an EaFsdModel with a drafter) on this machine."""
    from tqdm import tqdm

    from eagle_fsd import vocab as vocab_tables

    settings = settings or TuneSettings()
    target, drafter = model.base_model, model.drafter
    device = target.device
    ids = [x[0].to(device) for x in calibration_prompts(model.tokenizer, settings.prompts, settings.prompt_texts)]
    with torch.no_grad():
        first = model.naive_generate(ids[0][None], max_new_tokens=settings.new_tokens, return_dict=True)
        context = first.sequences[0]
        # the drafter's cost sets the search: a cheap one affords wide trees and a second reduced vocabulary,
        # an expensive one is replayed on fewer positions (settings.replay_seconds)
        probe = DraftSetup(drafter, context.to(device), _target_hidden(target, context.to(device)), room=24)
        first_ms = 1000 * sum(first.phase_seconds.values()) / first.verify_steps
        level1 = _timed_rounds({1: lambda: probe.level(1)}, 3)[1]
        top_ks = settings.top_ks or ((1, 2, 4, 8) if level1 < 0.1 * first_ms else
                                     (1, 2, 4) if level1 < 0.3 * first_ms else (1, 2))
        per_prompt = max(settings.new_tokens - settings.max_depth - 1, 1)
        affordable = settings.replay_seconds * 1000 / (per_prompt * level1 * (len(top_ks) * settings.max_depth + 1))
        ids = ids[: max(2, min(len(ids), int(affordable)))]
        # the target's own greedy continuations (plain decoding through the loop: also the measured t_plain)
        plain = [first] + [model.naive_generate(x[None], max_new_tokens=settings.new_tokens, return_dict=True)
                           for x in ids[1:]]
        # t_plain = t_verify(1), timed below with the other sizes, + the loop's own per-token work measured here
        steps = sum(o.verify_steps for o in plain)
        plain_loop_ms = 1000 * sum(sum(o.phase_seconds.values()) - o.phase_seconds["verify"] for o in plain) / steps
        order = vocab_tables.frequency_order(model.tokenizer)
        if settings.vocabs is not None:
            reduced = [v for v in settings.vocabs if v]
        else:
            reduced = vocab_tables.candidate_sizes(target.config.vocab_size, level1 < 0.2 * first_ms) if order is not None else []
        vocabs = {0: None, **{v: vocab_tables.draft_vocab(order, v).to(device) for v in reduced}}
        biggest_pool = max(k + settings.max_depth * k * k for k in top_ks) + 1
        sizes = tuple(sorted({1} | {n for n in settings.sizes if n <= biggest_pool}))
        verify_ms, level_ms, extend_ms = measure_costs(model, context, sizes, top_ks, vocabs, settings.rounds)
        plain_ms = verify_ms[1] + plain_loop_ms
        rows, ranks, continuations = [], [], []
        with tqdm(total=len(ids) * per_prompt, desc="eagle-fsd tune: acceptance replay", disable=not progress,
                  file=sys.stderr) as bar:
            for x, out in zip(ids, plain):
                continuations.append(out.sequences[0, x.numel():].tolist())
                r, rk = replay(model, x, out.sequences[0, x.numel():], top_ks, settings.max_depth, sizes, bar)
                rows.append(r)
                ranks += rk
    tau, by_depth = {}, {}
    for v, v_ids in vocabs.items():
        # a reduced vocabulary cannot propose a token outside it: the accepted path stops before the first one
        allowed = None if v_ids is None else set(v_ids.tolist())
        rows_v = [cut_to_vocab(r, g, allowed) for r, g in zip(rows, continuations)]
        for key in rows_v[0][0] if rows_v and rows_v[0] else []:
            steps = [walk_tau(r, key) for r in rows_v if r]
            tau[(*key, v)] = sum(steps) / len(steps)
        for k in top_ks:  # per-depth acceptance of the biggest tree of each top_k
            biggest = max((s for s in tau if s[1] == settings.max_depth and s[2] == k and s[3] == v), default=None)
            if biggest is not None:
                by_depth[(k, v)] = _acceptance_by_depth(rows_v, biggest[:3])
    profile = CostProfile(verify_ms, level_ms, extend_ms, 0.0, plain_ms, tau, by_depth,
                          rank_histogram=[round(ranks.count(r) / max(len(ranks), 1), 4) for r in range(9)])
    profile.overhead_ms = measure_overhead(model, ids[0], profile, settings.new_tokens, vocabs)
    return profile


def cut_to_vocab(rows: list[dict], continuation: list[int], allowed: set | None) -> list[dict]:
    """Accepted lengths when the drafter can only propose tokens in `allowed` (None: all): at position j the path
    holds continuation[j + 1 ..]; it ends before the first token outside the vocabulary. (A lower bound: without
    the excluded competitors the reduced drafter ranks the remaining path tokens at least as high.)"""
    if allowed is None:
        return rows
    out = []
    for j, lengths in enumerate(rows):
        inside = 0
        while j + 1 + inside < len(continuation) and continuation[j + 1 + inside] in allowed:
            inside += 1
        out.append({key: min(a, inside) for key, a in lengths.items()})
    return out


def _acceptance_by_depth(rows, key) -> list[float]:
    from eagle_fsd.tree.accept import acceptance_by_depth

    return [round(x, 4) for x in acceptance_by_depth([pos[key] for r in rows for pos in r])]


def measure_overhead(model, prompt: torch.Tensor, profile: CostProfile, new_tokens: int, vocabs: dict) -> float:
    """The engine's per-step cost beyond the modelled forwards, from real steps at the provisional best shape."""
    shape, _ = choose_shape(profile)
    saved = (model.total_token, model.depth, model.top_k)
    model.set_tree(*shape[:3])
    model.drafter.draft_head.set_draft_vocab(vocabs[shape[3]])
    try:
        runs = [model.generate(prompt[None], max_new_tokens=new_tokens, return_dict=True) for _ in range(3)]
    finally:
        model.set_tree(*saved)
        model.drafter.draft_head.set_draft_vocab(None)
    # the loop's time outside the target forward, less the modelled draft forwards (t_verify is timed apart)
    n, d, k, v = shape
    drafting = d * profile.level_ms[(k, v)] + profile.extend_ms[v]
    measured = statistics.median(1000 * (sum(o.phase_seconds.values()) - o.phase_seconds["verify"]) / o.verify_steps
                                 for o in runs)
    return max(0.0, measured - drafting)


# ---------------------------------------------------------------- cache and the engine hook
def cache_key(model, base_model, drafter_name, settings: TuneSettings | None = None) -> dict:
    target = model.base_model
    drafter_id = drafter_name if isinstance(drafter_name, str) else type(model.drafter).__name__
    key = {"model": str(base_model), "drafter": str(drafter_id), "device": device_name(target.device),
           "dtype": str(target.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
           "torch": torch.__version__.split("+")[0], "tune_version": TUNE_VERSION}
    if settings is not None and settings != TuneSettings():
        key["settings"] = hashlib.sha256(repr(settings).encode()).hexdigest()[:12]
    return key


def cache_path(key: dict) -> Path:
    from eagle_fsd.presets import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = Path(key["model"]).name.replace("/", "_")
    return cache_dir() / "tune" / f"{name}-{digest}.json"


def load_or_measure(model, base_model, drafter_name, progress: bool = True, refresh: bool = False,
                    settings: TuneSettings | None = None) -> tuple[CostProfile, Path]:
    key = cache_key(model, base_model, drafter_name, settings)
    path = cache_path(key)
    if path.is_file() and not refresh:
        try:
            return CostProfile.from_json(json.loads(path.read_text())["profile"]), path
        except (ValueError, KeyError, TypeError):
            pass  # an unreadable or older cache file: measure again
    if progress:
        print(f"eagle-fsd: measuring speculation costs on this machine ({key['device']}, {key['dtype']}, "
              f"{key['threads']} threads); cached in {path}", file=sys.stderr)
    profile = measure(model, settings, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "profile": profile.to_json()}, indent=1))
    tmp.replace(path)
    return profile, path


def apply_tuning(model, tuning: Tuning) -> None:
    """Install a tuning on an EaFsdModel: its tree, its draft vocabulary and the speed guard's plain rate."""
    from eagle_fsd import vocab as vocab_tables

    n, d, k, v = tuning.shape
    model.set_tree(n, d, k)
    ids = None
    if v:
        ids = vocab_tables.draft_vocab(vocab_tables.frequency_order(model.tokenizer), v).to(model.base_model.device)
    model.drafter.draft_head.set_draft_vocab(ids)
    model.tuning = tuning


def autotune(model, base_model, drafter_name, auto, fixed: dict, progress: bool = True,
             settings: TuneSettings | None = None) -> Tuning:
    """Resolve "auto" tree settings of `model` from the (cached) cost profile; install the tuning on the model."""
    profile, path = load_or_measure(model, base_model, drafter_name, progress=progress, settings=settings)
    tuning = tuning_from(profile, {k: v for k, v in fixed.items() if k not in auto}, str(path))
    apply_tuning(model, tuning)
    if progress:
        print(f"eagle-fsd: {describe(tuning)}", file=sys.stderr)
    return tuning


def describe(tuning: Tuning) -> str:
    n, d, k, v = tuning.shape
    tree = f"tree (total_token, depth, top_k) = ({n}, {d}, {k}), draft vocabulary {v or 'full'}"
    if tuning.speculate:
        return f"{tree}; predicted {tuning.predicted_speedup:.2f}x plain decoding"
    return (f"plain decoding: the best {tree} is predicted at {tuning.predicted_speedup:.2f}x, slower than plain "
            "(speculation is re-tried from time to time)")


# ---------------------------------------------------------------- dtype
def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(flags: set[str] | None = None) -> bool:
    """bf16 matmul in hardware: AMX-BF16 or AVX-512 BF16 (without them bf16 GEMMs are emulated and their cost
    grows linearly with rows)."""
    flags = cpu_flags() if flags is None else flags
    return bool({"amx_bf16", "avx512_bf16"} & flags)


@functools.lru_cache(maxsize=None)
def bf16_measures_faster(hidden: int = 1536, intermediate: int = 8960) -> bool:
    """The model's MLP up-projection (hidden -> intermediate) over 1, 4 and 8 rows (plain steps and small trees),
    bf16 against fp32 on this CPU, timed round-robin: bf16 when the three together take less time."""
    w32 = torch.randn(intermediate, hidden)
    w16 = w32.bfloat16()
    inputs = {rows: torch.randn(rows, hidden) for rows in (1, 4, 8)}
    fns = {}
    for rows, x32 in inputs.items():
        x16 = x32.bfloat16()
        fns[("bf16", rows)] = lambda x=x16: torch.nn.functional.linear(x, w16)
        fns[("fp32", rows)] = lambda x=x32: torch.nn.functional.linear(x, w32)
    timed = _timed_rounds(fns, rounds=9)
    total = {dt: sum(t for (name, _), t in timed.items() if name == dt) for dt in ("bf16", "fp32")}
    return total["bf16"] < total["fp32"]


def resolve_dtype(dtype, device_map=None, config=None):
    """dtype "auto": CUDA -> bf16 (fp16 without bf16 support); CPU -> bf16 only with native bf16 matmul that
    also measures faster on the model's own MLP shape (`config`; 1, 4 and 8 rows together), else fp32. Anything
    else is returned unchanged."""
    if dtype != "auto":
        return dtype
    on_cuda = torch.cuda.is_available() and device_map is not None and "cpu" not in str(device_map)
    if on_cuda:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if not native_bf16():
        return torch.float32
    shape = () if config is None else (config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size))
    return torch.bfloat16 if bf16_measures_faster(*shape) else torch.float32


# ---------------------------------------------------------------- CLI: eagle-fsd tune
def main(argv=None) -> int:
    import argparse

    from eagle_fsd.model import EaFsdModel

    p = argparse.ArgumentParser(prog="eagle-fsd tune", description="measure the speculation cost model on this "
                                "machine, print the predicted speedup of each tree shape and cache the profile")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default=None, help="LM drafter (preset, dir or hub id); default: the preset's")
    p.add_argument("--ea-model-path", default=None, help="EAGLE-1/2 head (dir or hub id)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    p.add_argument("--top", type=int, default=8, help="print the N best shapes")
    p.add_argument("--plot", default=None, help="write the cost curves (t_verify(n) / t_verify(1)) to this PNG")
    p.add_argument("--mtbench", type=int, default=0, metavar="N",
                   help="analysis: measure acceptance on the first turns of the first N MT-Bench questions instead "
                        "of the shipped calibration prompts (what that evaluation set allows; cached apart)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = EaFsdModel.from_pretrained(args.model, ea_model_path=args.ea_model_path, draft_model=args.drafter,
                                       dtype=dtype, total_token=1, depth=1, top_k=1)  # the tree is measured below
    if model.drafter is None:
        raise ValueError(f"{args.model!r} has no default drafter: pass --drafter or --ea-model-path")
    settings = None
    if args.mtbench:
        from eagle_fsd.eval.data import load_questions

        texts = tuple(q["turns"][0] for q in load_questions()[: args.mtbench])
        settings = TuneSettings(prompts=len(texts), prompt_texts=texts)
    drafter_name = args.ea_model_path or args.drafter
    if drafter_name is None:  # the preset's default drafter, named as from_pretrained names it
        from eagle_fsd import presets

        drafter_name = presets.shipped_head(args.model) or presets.default_drafter(args.model)
    profile, path = load_or_measure(model, args.model, drafter_name, refresh=args.refresh, settings=settings)
    print(f"cost profile: {path}")
    print(format_profile(profile, args.top))
    if args.plot:
        plot_cost_curves({f"{args.model} ({str(model.base_model.dtype).replace('torch.', '')})": profile}, args.plot)
        print(f"wrote {args.plot}")
    return 0


def plot_cost_curves(profiles: dict[str, CostProfile], path: str) -> None:
    """t_verify(n) / t_verify(1) per profile, and the best predicted speedup for each tree size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cost, gain) = plt.subplots(1, 2, figsize=(10, 4))
    for label, profile in profiles.items():
        sizes = sorted(profile.verify_ms)
        base = profile.verify_ms[sizes[0]]
        cost.plot(sizes, [profile.verify_ms[n] / base for n in sizes], marker="o", label=label)
        best = [max((profile.speedup(s) for s in profile.tau if s[0] == n), default=float("nan")) for n in sizes]
        gain.plot(sizes, best, marker="o", label=label)
    cost.plot([1, max(max(p.verify_ms) for p in profiles.values())], [1, max(max(p.verify_ms) for p in profiles.values())],
              ls=":", color="grey", label="linear in n")
    cost.set(xlabel="tree tokens verified (n)", ylabel="t_verify(n) / t_verify(1)", xscale="log", yscale="log",
             title="verification cost, measured")
    gain.axhline(1.0, ls=":", color="grey")
    gain.set(xlabel="tree tokens verified (n)", ylabel="predicted speedup over plain", xscale="log",
             title="best shape of each size, predicted")
    for ax in (cost, gain):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_profile(profile: CostProfile, top: int = 8) -> str:
    base = profile.verify_ms[min(profile.verify_ms)]
    lines = ["t_verify(n) / t_verify(1): " + "  ".join(f"{n}:{v / base:.2f}" for n, v in sorted(profile.verify_ms.items())),
             f"t_plain {profile.plain_ms:.1f} ms/token, t_verify(1) {base:.1f} ms; draft level (k, vocab) "
             + ", ".join(f"({k}, {v or 'full'}): {t:.1f}" for (k, v), t in sorted(profile.level_ms.items()))
             + " ms; catch-up " + ", ".join(f"{v or 'full'}: {t:.1f}" for v, t in sorted(profile.extend_ms.items()))
             + f" ms; engine overhead {profile.overhead_ms:.1f} ms/step",
             f"{'total_token':>11} {'depth':>5} {'top_k':>5} {'vocab':>6} {'tau':>6} {'step ms':>8} {'speedup':>8}"]
    ranked = sorted(profile.tau, key=profile.speedup, reverse=True)[:top]
    for s in ranked:
        lines.append(f"{s[0]:>11} {s[1]:>5} {s[2]:>5} {s[3] or 'full':>6} {profile.tau[s]:>6.2f} "
                     f"{profile.step_ms(s):>8.1f} {profile.speedup(s):>7.2f}x")
    best, speedup = choose_shape(profile)
    verdict = f"speculate with {best}" if speedup > 1 else "decode plainly (no shape beats plain decoding)"
    lines.append(f"choice: {verdict}, predicted {speedup:.2f}x")
    return "\n".join(lines)
