"""Timing every term of the cost model on this machine, through the real engine: target forwards over n new tokens,
draft forwards over k nodes, the drafter's catch-up, the engine's own per-step cost and plain decoding; acceptance
by replay (eagle_fsd.tune.replay)."""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from eagle_fsd import vocab as vocab_tables
from eagle_fsd.cache import TreeCache
from eagle_fsd.hf import causal_mask, decoder_forward
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tune.profile import CostProfile, choose_shape, nondecreasing
from eagle_fsd.tune.replay import RANKS, replay_prompts, target_hidden, tau_by_shape
from eagle_fsd.tune.trust import TimingWatch

SIZES = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)  # candidate total_token (tree nodes, root included)
TOP_KS = (1, 2, 4, 8)  # candidate branching (EAGLE's top_k)
MAX_DEPTH = 6
MIN_POSITIONS = 16  # replayed positions per calibration prompt, however expensive the drafter
# tokens cached before a step's rows when costs are timed: mid-answer for chat (prompts near 100 tokens, 256-512 new
# ones), and a short context beside it. Attention over the cache grows with it (a verification of 16 rows costs
# ~15 % less at 150 tokens than at 256): the profile takes each cost as linear between the two (CostProfile.at_context).
TIMING_CONTEXT = 256
SHORT_CONTEXT = 64
CALIBRATION_FILE = Path(__file__).parent.parent / "calibration.json"


@dataclass
class TuneSettings:
    """How much the tuner measures. Up to prompts x new_tokens calibration positions (the tree replay reads fewer
    positions of each prompt for an expensive drafter, to keep it near replay_seconds; the rules' replay reads them
    all); top_ks / max_depth / sizes bound the shapes tried (top_ks None: chosen from the drafter's cost); vocabs
    None: the full vocabulary plus the reduced sizes of vocab.candidate_sizes when a frequency table exists for the
    tokenizer; rounds: timing repeats; on a busy machine (eagle_fsd.tune.trust) the costs are timed again after
    busy_wait seconds, up to retries times; timing_context / short_context: the cache lengths costs are timed at."""

    prompts: int = 12  # every shipped calibration prompt
    new_tokens: int = 64
    top_ks: tuple[int, ...] | None = None
    max_depth: int = MAX_DEPTH
    sizes: tuple[int, ...] = SIZES
    vocabs: tuple[int, ...] | None = None
    rounds: int = 7
    replay_seconds: float = 90.0
    prompt_texts: tuple[str, ...] | None = None  # None: the shipped calibration prompts
    retries: int = 2
    busy_wait: float = 10.0
    timing_context: int = TIMING_CONTEXT
    short_context: int = SHORT_CONTEXT


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_rounds(fns: dict, rounds: int, before=None, watch: TimingWatch | None = None) -> dict:
    """Median ms of each fn, measured round-robin (every round times each fn once), so that slow drift of a
    shared machine hits all of them alike. `before` (one callable, or one per key) runs untimed ahead of each call
    (e.g. evicting caches). `watch` records the CPU share and the spread of the rounds (eagle_fsd.tune.trust)."""
    times = {key: [] for key in fns}
    befores = before if isinstance(before, dict) else dict.fromkeys(fns, before)
    started = watch.start() if watch is not None else None
    for _ in range(rounds):
        for key, fn in fns.items():
            if befores.get(key) is not None:
                befores[key]()
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            times[key].append((time.perf_counter() - start) * 1000)
    if watch is not None:
        watch.stop(started, times)
    return {key: statistics.median(t) for key, t in times.items()}


def calibration_prompts(tokenizer, count: int, texts=None) -> list[torch.Tensor]:
    """The first `count` prompts (the shipped calibration prompts unless `texts`), through the chat template."""
    texts = list(texts or json.loads(CALIBRATION_FILE.read_text())["prompts"])[:count]
    if tokenizer.chat_template:
        return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"] for t in texts]
    return [tokenizer(t, return_tensors="pt")["input_ids"] for t in texts]


def timing_context(model, settings: TuneSettings, length: int | None = None) -> torch.Tensor:
    """The context costs are timed on: the calibration prompts end to end, repeated and cut to `length` tokens
    (default settings.timing_context; at most half the model's context). Only its length matters to a timing."""
    ids = torch.cat([x[0] for x in calibration_prompts(model.tokenizer, settings.prompts, settings.prompt_texts)])
    length = length or settings.timing_context
    limit = getattr(model.base_model.config, "max_position_embeddings", None)
    if limit:
        length = min(length, limit // 2)
    return ids.repeat(-(-length // ids.numel()))[:length].to(model.base_model.device)


class DraftSetup:
    """A drafter primed on a context, to time its forwards as the engine runs them (through the Drafter
    contract of eagle_fsd.drafting)."""

    def __init__(self, drafter, context: torch.Tensor, target_hidden: torch.Tensor, room: int):
        self.drafter = drafter
        drafter.reset(context.numel() + room)
        self.logits, self.state = drafter.prefill(context[:-1], context[-1], target_hidden[:-1])
        self.length = drafter.length
        # a step's catch-up: three accepted tokens, or for a drafter that keeps its level entries
        # (Drafter.keep_levels) mostly the bonus token alone
        read = 3 if drafter.reads_features else 1
        self.tokens, self.hidden = context[-read:], target_hidden[-read:]

    def level(self, k: int) -> None:
        """Level 0 of a tree: the root's top-k children, one draft forward."""
        d = self.drafter
        tokens = self.logits.topk(k).indices
        tokens = tokens if d.draft_vocab is None else d.draft_vocab[tokens]
        states = None if self.state is None else self.state[None].expand(k, -1)
        d.forward_level(tokens, states, 0, torch.eye(k, dtype=torch.bool, device=tokens.device))
        d.rollback()

    def extend(self) -> None:
        """A step's catch-up, then back."""
        d = self.drafter
        d.extend(self.tokens, self.hidden)
        d.rewind(self.length)


def new_watch(model) -> TimingWatch:
    return TimingWatch(torch.get_num_threads(), on_cpu=model.base_model.device.type == "cpu")


def measure_costs(model, contexts: list[torch.Tensor], sizes, top_ks, vocabs: dict, rounds: int,
                  watch: TimingWatch | None = None) -> list[tuple[dict, dict, dict]]:
    """(verify_ms per tree size, level_ms per (k, v), extend_ms per v) at each of `contexts`, in their order. The
    target forwards of every context are timed in one round-robin, so that a shared machine's drift moves them alike
    and their differences (CostProfile's slopes) stay the context's; draft forwards run between the timed target
    forwards, as in the engine (they evict the target's weights from the caches). The drafter's forwards are timed in
    passes of their own (one per context and vocabulary), each beside t_verify(1) again: a drafter cost is taken as
    t_draft · t_verify(1) / t_verify(1)', its ratio to the target's one-token forward in that pass on the clock of
    the target's pass, so that drift between passes does not move a drafting cost against verification's."""
    target, drafter, run = model.base_model, model.drafter, model.plan.target
    device, lm_head, primed = target.device, target.get_output_embeddings(), []
    for context in contexts:
        ctx = context.to(device)
        cache = TreeCache.for_model(target, ctx.numel() + max(sizes), run)
        decoder_forward(target, ctx, cache, causal_mask(0, ctx.numel(), device),
                        torch.arange(ctx.numel(), device=device), run)
        primed.append((ctx, target_hidden(model, ctx), cache, ctx[-1:].repeat(max(sizes))))

    def verify(i, n):
        (ctx, _, cache, new), base = primed[i], primed[i][0].numel()
        lm_head(decoder_forward(target, new[:n], cache, causal_mask(base, n, device),
                                base + torch.arange(n, device=device), run))
        cache.crop(base)

    setup = DraftSetup(drafter, primed[0][0], primed[0][1], room=16 + 2 * max(top_ks))
    verify(0, 1)
    verify_ms = timed_rounds({(i, n): (lambda i=i, n=n: verify(i, n)) for i in range(len(primed)) for n in sizes},
                             rounds, before=lambda: setup.level(1), watch=watch)
    costs = []
    for i, (ctx, hidden, _, _) in enumerate(primed):  # the drafter holds one context at a time: timed one by one
        fitted = nondecreasing({n: verify_ms[(i, n)] for n in sizes})  # more tokens never cost less
        level_ms, extend_ms = {}, {}
        for v, ids in vocabs.items():
            with drafter.drafting_over(ids):
                setup = DraftSetup(drafter, ctx, hidden, room=16 + 2 * max(top_ks))
                fns = {("level", k): (lambda k=k: setup.level(k)) for k in top_ks}
                fns["extend"] = setup.extend
                fns["one token"] = lambda i=i: verify(i, 1)  # the target's t_verify(1), timed again in this pass
                befores = {key: lambda i=i: verify(i, 1) for key in fns} | {"one token": lambda: setup.level(1)}
                setup.level(1)
                timed = timed_rounds(fns, rounds, before=befores, watch=watch)
            clock = fitted[1] / timed.pop("one token")  # this pass's drift against the target's pass
            extend_ms[v] = clock * timed.pop("extend")
            level_ms.update({(k, v): clock * t for (_, k), t in timed.items()})
        costs.append((fitted, level_ms, extend_ms))
    return costs


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


def draft_level_cost(model, first) -> tuple[float, float]:
    """(ms of one draft forward over one node, ms of one plain step of `first`, a plain decoding run)."""
    context = first.sequences[0].to(model.base_model.device)
    probe = DraftSetup(model.drafter, context, target_hidden(model, context), room=24)
    step_ms = 1000 * sum(first.phase_seconds.values()) / first.verify_steps
    return timed_rounds({1: lambda: probe.level(1)}, 3)[1], step_ms


def search_space(settings: TuneSettings, level1: float, step_ms: float, prompts: int) -> tuple[tuple, int]:
    """The drafter's cost sets the search: a cheap one affords wide trees, an expensive one is replayed over fewer
    positions of every prompt (settings.replay_seconds; at least MIN_POSITIONS each). Every prompt stays in: the
    prompts differ in how predictable they are, so E[a + 1] from the first two or three alone swings with which ones
    they are. Returns (top_ks, positions replayed per prompt)."""
    top_ks = settings.top_ks or ((1, 2, 4, 8) if level1 < 0.1 * step_ms else
                                 (1, 2, 4) if level1 < 0.3 * step_ms else (1, 2))
    per_prompt = max(settings.new_tokens - settings.max_depth - 1, 1)
    affordable = settings.replay_seconds * 1000 / (prompts * level1 * (len(top_ks) * settings.max_depth + 1))
    return top_ks, min(per_prompt, max(MIN_POSITIONS, int(affordable)))


def draft_vocabularies(model, settings: TuneSettings, cheap: bool) -> dict:
    """{size v: target ids} of the draft vocabularies to try; 0: the full vocabulary (None). A cheap drafter also
    tries a second reduced size (vocab.candidate_sizes)."""
    if not model.drafter.reducible_vocab:  # an EAGLE-3 head brings its own draft vocabulary
        return {0: None}
    order = vocab_tables.frequency_order(model.tokenizer)
    if settings.vocabs is not None:
        reduced = [v for v in settings.vocabs if v]
    else:
        reduced = vocab_tables.candidate_sizes(model.base_model.config.vocab_size, cheap) if order is not None else []
    return {0: None, **{v: vocab_ids(model, v) for v in reduced}}


def plain_loop_ms(plain: list) -> float:
    """The loop's own per-token work in plain decoding runs, beyond the target forward."""
    steps = sum(o.verify_steps for o in plain)
    return 1000 * sum(sum(o.phase_seconds.values()) - o.phase_seconds["verify"] for o in plain) / steps


def measure(model, settings: TuneSettings | None = None, progress: bool = True) -> CostProfile:
    """Measure a CostProfile for `model` (an EaFsdModel with a drafter) on this machine."""
    settings = settings or TuneSettings()
    device = model.base_model.device
    ids = [x[0].to(device) for x in calibration_prompts(model.tokenizer, settings.prompts, settings.prompt_texts)]
    with torch.no_grad():
        first = model.naive_generate(ids[0][None], max_new_tokens=settings.new_tokens, return_dict=True)
        level1, step_ms = draft_level_cost(model, first)
        top_ks, positions = search_space(settings, level1, step_ms, len(ids))
        # the target's own greedy continuations (plain decoding through the loop: also the measured t_plain); the
        # positions the tree replay cannot afford still serve the rules' replay (rule_replay), which is cheap
        plain = [first] + [model.naive_generate(x[None], max_new_tokens=settings.new_tokens, return_dict=True)
                           for x in ids[1:]]
        calibration = [[out.sequences[0].tolist(), x.numel()] for x, out in zip(ids, plain)]
        vocabs = draft_vocabularies(model, settings, level1 < 0.2 * step_ms)
        biggest_pool = max(k + settings.max_depth * k * k for k in top_ks) + 1
        sizes = tuple(sorted({1} | {n for n in settings.sizes if n <= biggest_pool}))
        (verify_ms, level_ms, extend_ms), slopes, context, watch = timed_costs(model, sizes, top_ks, vocabs,
                                                                               settings, progress)
        # t_plain = t_verify(1), timed with the other sizes, + the loop's own per-token work
        plain_ms = verify_ms[1] + plain_loop_ms(plain)
        rows, ranks, continuations = replay_prompts(model, ids, plain, top_ks, settings, sizes, progress, positions)
    tau, by_depth = tau_by_shape(rows, continuations, vocabs, top_ks, settings.max_depth)
    profile = CostProfile(verify_ms, level_ms, extend_ms, 0.0, plain_ms, tau, by_depth,
                          rank_histogram=[round(ranks.count(r) / max(len(ranks), 1), 4) for r in range(RANKS + 1)],
                          context_tokens=context, **slopes)
    profile.overhead_ms = measure_overhead(model, ids[0], profile, settings.new_tokens)
    with torch.no_grad():
        profile.prefill_ms, profile.draft_prefill_ms = measure_prefill(model, first.sequences[0], settings.rounds,
                                                                       watch)
    profile.conditions = watch.conditions()
    profile.calibration = calibration
    return profile


def timed_costs(model, sizes, top_ks, vocabs, settings: TuneSettings, progress: bool):
    """The costs timed at settings.timing_context cached tokens and at settings.short_context: ((verify_ms,
    level_ms, extend_ms) at the long one, their slopes in ms per cached token (CostProfile's verify_slope,
    level_slope, extend_slope; empty when the model's context leaves no room for two), its length, the watch)."""
    context = timing_context(model, settings)
    short = timing_context(model, settings, settings.short_context)
    contexts = [context] + ([short] if short.numel() < context.numel() else [])
    (costs, *others), watch = costs_when_quiet(model, contexts, sizes, top_ks, vocabs, settings, progress)
    if not others:
        return costs, {}, context.numel(), watch
    span = context.numel() - short.numel()
    slopes = {name: {key: (long[key] - brief[key]) / span for key in long}
              for name, long, brief in zip(("verify_slope", "level_slope", "extend_slope"), costs, others[0])}
    return costs, slopes, context.numel(), watch


def costs_when_quiet(model, contexts, sizes, top_ks, vocabs, settings: TuneSettings, progress: bool):
    """measure_costs, timed again after a pause while the machine looks busy (up to settings.retries times):
    ([(verify_ms, level_ms, extend_ms) per context], the watch of the attempt kept)."""
    for attempt in range(settings.retries + 1):
        watch = new_watch(model)
        costs = measure_costs(model, contexts, sizes, top_ks, vocabs, settings.rounds, watch)
        busy = watch.busy_reason()
        if busy is None or attempt == settings.retries:
            return costs, watch
        if progress:
            print(f"eagle-fsd: the machine looks busy ({busy}); timing again in {settings.busy_wait:.0f} s",
                  file=sys.stderr)
        time.sleep(settings.busy_wait)


def check_costs(model, profile: CostProfile, margin: float = 1.25, rounds: int = 3,
                settings: TuneSettings | None = None) -> tuple[CostProfile, str]:
    """A cached profile checked against this machine now: a short plain run and a few timed forwards of the terms of
    the profile's best shape (t_plain, t_verify(1), t_verify(n), t_level(k, v)). When one of them, relative to
    t_plain, is off by more than `margin` either way on a quiet machine, every cost is timed again (acceptance is
    kept: it does not depend on the machine). Returns (the profile to use, what was found); the profile is `profile`
    itself when it held."""
    settings = settings or TuneSettings()
    n, _, k, v = choose_shape(profile)[0]
    device = model.base_model.device
    prompt = calibration_prompts(model.tokenizer, 1, settings.prompt_texts)[0][0].to(device)
    watch = new_watch(model)
    with torch.no_grad():
        run = model.naive_generate(prompt[None], max_new_tokens=24, return_dict=True)
        context = timing_context(model, settings)  # where the profile's costs were timed
        verify_ms, level_ms, _ = measure_costs(model, [context], (1, n), (k,), {v: vocab_ids(model, v)}, rounds,
                                               watch)[0]
    busy = watch.busy_reason()
    if busy is not None:
        return profile, f"not checked: the machine is busy now ({busy})"
    names = ("t_plain", "t_verify(1)", f"t_verify({n})", f"t_level({k}, {v or 'full'})")
    now = dict(zip(names, (verify_ms[1] + plain_loop_ms([run]), verify_ms[1], verify_ms[n], level_ms[(k, v)])))
    cached = dict(zip(names, (profile.plain_ms, profile.verify_ms[1], profile.verify_ms[n], profile.level_ms[(k, v)])))
    drift, off = disagreements(cached, now, margin)
    if not off:
        return profile, f"checked: its costs hold on this machine now (all x{drift:.2f} of the cached ones)"
    found = ", ".join(f"{name} {cached[name]:.1f} ms cached, {now[name]:.1f} ms now" for name in off)
    sizes = tuple(sorted(profile.verify_ms))
    top_ks = tuple(sorted({kk for kk, _ in profile.level_ms}))
    vocabs = {vv: vocab_ids(model, vv) for vv in sorted(profile.extend_ms)}
    with torch.no_grad():
        (verify_ms, level_ms, extend_ms), slopes, _, watch = timed_costs(model, sizes, top_ks, vocabs, settings,
                                                                         progress=False)
        prefill_ms, draft_prefill_ms = measure_prefill(model, prompt, settings.rounds, watch)
    healed = replace(profile, verify_ms=verify_ms, level_ms=level_ms, extend_ms=extend_ms, **slopes,
                     plain_ms=verify_ms[1] + plain_loop_ms([run]), prefill_ms=prefill_ms,
                     draft_prefill_ms=draft_prefill_ms, conditions={**watch.conditions(), "healed_from": found})
    return healed, f"re-timed: it disagreed with this machine now ({found})"


def disagreements(cached: dict[str, float], now: dict[str, float], margin: float) -> tuple[float, list[str]]:
    """(drift = t_plain now / cached, the terms off by more than `margin` either way once scaled by the drift).
    A machine uniformly slower or faster now than when tuned keeps every choice (the speed guard follows its speed):
    what must hold is each cost relative to t_plain."""
    drift = now["t_plain"] / cached["t_plain"]
    return drift, [name for name in now if not 1 / margin <= now[name] / (cached[name] * drift) <= margin]


def vocab_ids(model, size: int):
    """The target ids of a draft vocabulary of `size` tokens (0: None, the full vocabulary)."""
    if not size:
        return None
    return vocab_tables.draft_vocab(vocab_tables.frequency_order(model.tokenizer), size).to(model.base_model.device)


def measure_prefill(model, prompt: torch.Tensor, rounds: int, watch: TimingWatch | None = None) -> tuple[float, float]:
    """ms per prompt token of the target's prefill (forward from an empty cache, lm_head on the last position)
    and of the drafter's (over the same prompt, from the target's features), timed round-robin."""
    target, drafter = model.base_model, model.drafter
    ids = prompt.to(target.device)
    n = ids.numel()
    hidden = target_hidden(model, ids)
    lm_head = target.get_output_embeddings()

    def target_prefill():
        cache = TreeCache.for_model(target, n, model.plan.target)
        lm_head(decoder_forward(target, ids, cache, causal_mask(0, n, target.device),
                                torch.arange(n, device=target.device), model.plan.target)[-1:])

    def draft_prefill():
        drafter.reset(n + 1)
        drafter.prefill(ids[:-1], ids[-1], hidden[:-1])

    timed = timed_rounds({"target": target_prefill, "drafter": draft_prefill}, rounds, watch=watch)
    return timed["target"] / n, timed["drafter"] / n


def measure_overhead(model, prompt: torch.Tensor, profile: CostProfile, new_tokens: int) -> float:
    """The engine's per-step cost beyond the modelled forwards, from real steps at the provisional best shape
    (passed to generate, so without the speed guard)."""
    shape, _ = choose_shape(profile)
    runs = [model.generate(prompt[None], max_new_tokens=new_tokens, return_dict=True, shape=TreeShape(*shape))
            for _ in range(3)]
    # the loop's time outside the target forward and the drafter's one read of the prompt, less the modelled draft
    # forwards (t_verify is timed apart)
    n, d, k, v = shape
    drafting = d * profile.level_ms[(k, v)] + profile.extend_ms[v]
    measured = statistics.median(1000 * (sum(o.phase_seconds.values()) - o.phase_seconds["verify"]
                                         - o.phase_seconds.get("draft_prefill", 0.0)) / o.verify_steps for o in runs)
    return max(0.0, measured - drafting)
