"""The cost model (pure): measured costs and acceptance, the predicted speedup of a tree shape, and its argmax.

    t_step(n, d, k, v) = t_verify(n) + d * t_level(k, v) + t_extend(v) + t_overhead
    speedup(n, d, k, v) = E[a + 1 | n, d, k, v] * t_plain / t_step(n, d, k, v)

and for a whole generation of N new tokens after a prompt of P tokens (both decoders prefill the target; speculation
also prefills the drafter):

    speedup(shape; P, N) = (P t_prefill + N t_plain) / (P (t_prefill + t_draft_prefill) + N t_step(shape) / E[a + 1])

Every forward reads the cache, so each cost grows with the tokens cached before the step, L. The costs are timed at
two contexts, C (the profile's `context_tokens`) and a shorter one, and taken as linear in L between and beyond them:

    t(L) = t(C) + s (L - C),   s = (t(C) - t(C_short)) / (C - C_short)

per term (t_verify(n), t_level(k, v), t_extend(v); t_plain moves with t_verify(1)). A generation's steps run at
contexts spread over [P, P + N], so its costs are those at its mean context, P + N / 2 (`at_context`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from eagle_fsd.tree.shape import TreeShape

Shape = tuple[int, int, int, int]  # (total_token n, depth d, branching k, draft vocabulary size v; 0 = full)
_KEYED = ("verify_ms", "level_ms", "extend_ms", "tau", "acceptance_by_depth",  # dicts with int / tuple keys
          "verify_slope", "level_slope", "extend_slope")


@dataclass
class CostProfile:
    """Measured costs (milliseconds) and acceptance. Keys of the dicts are ints (tree size, width) or shapes."""

    verify_ms: dict[int, float]                 # target forward + lm_head over n new tokens atop a cache
    level_ms: dict[tuple[int, int], float]      # (k, v): one draft forward over k tree nodes (+ its lm_head)
    extend_ms: dict[int, float]                 # v: the drafter's catch-up over a step's accepted tokens
    overhead_ms: float                          # the engine's own work per speculative step (tree, accept, cache)
    plain_ms: float                             # one token of plain decoding through the same loop
    tau: dict[Shape, float]                     # (n, d, k, v) -> E[a + 1], from the replay
    acceptance_by_depth: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (k, v) -> P(d | d-1)
    rank_histogram: list[float] = field(default_factory=list)  # P(target's token is the drafter's r-th choice)
    prefill_ms: float = 0.0                     # per prompt token: the target's prefill
    draft_prefill_ms: float = 0.0               # per prompt token: the drafter's prefill
    conditions: dict = field(default_factory=dict)  # how the timings were taken (eagle_fsd.tune.trust)
    calibration: list = field(default_factory=list)  # [prompt + greedy continuation ids, prompt length] per prompt
    context_tokens: int = 0                     # tokens cached when the costs above were timed (0: not known)
    verify_slope: dict[int, float] = field(default_factory=dict)   # ms per cached token: d t_verify(n) / dL
    level_slope: dict[tuple[int, int], float] = field(default_factory=dict)  # d t_level(k, v) / dL
    extend_slope: dict[int, float] = field(default_factory=dict)   # d t_extend(v) / dL

    def step_ms(self, shape: Shape) -> float:
        n, d, k, v = shape
        return self.verify_ms[n] + d * self.level_ms[(k, v)] + self.extend_ms[v] + self.overhead_ms

    def speedup(self, shape: Shape) -> float:
        return self.tau[shape] * self.plain_ms / self.step_ms(shape)

    def workload_speedup(self, shape: Shape, prompt_tokens: float, new_tokens: float) -> float:
        """Whole generations: prompt and new tokens summed over them (see the module docstring)."""
        return workload_speedup(self.prefill_ms, self.draft_prefill_ms, self.plain_ms,
                                self.step_ms(shape) / self.tau[shape], prompt_tokens, new_tokens)

    def at_context(self, tokens: float) -> "CostProfile":
        """The profile with every cost moved to `tokens` cached tokens (module docstring); itself when the costs were
        timed at one context only."""
        if not self.context_tokens or not self.verify_slope:
            return self
        shift = tokens - self.context_tokens

        def moved(costs: dict, slopes: dict) -> dict:  # a cost never drops below a tenth of the timed one
            return {key: max(ms + slopes.get(key, 0.0) * shift, 0.1 * ms) for key, ms in costs.items()}

        verify = moved(self.verify_ms, self.verify_slope)
        return replace(self, verify_ms=verify, level_ms=moved(self.level_ms, self.level_slope),
                       extend_ms=moved(self.extend_ms, self.extend_slope),
                       plain_ms=self.plain_ms + verify.get(1, 0.0) - self.verify_ms.get(1, 0.0),
                       context_tokens=round(tokens))

    def to_json(self) -> dict:
        def keyed(d):
            return {",".join(map(str, k)) if isinstance(k, tuple) else str(k): v for k, v in d.items()}

        out = asdict(self)
        for name in _KEYED:
            out[name] = keyed(out[name])
        return out

    @classmethod
    def from_json(cls, raw: dict) -> "CostProfile":
        def unkeyed(d):
            return {tuple(int(x) for x in k.split(",")) if "," in k else int(k): v for k, v in d.items()}

        raw = dict(raw)
        for name in _KEYED:
            raw[name] = unkeyed(raw.get(name, {}))
        return cls(**raw)


def choose_shape(profile: CostProfile, total_token: int | None = None, depth: int | None = None,
                 branching: int | None = None, draft_vocab: int | None = None) -> tuple[Shape, float]:
    """The shape (n, d, k, v) with the highest predicted speedup (ties: the smaller tree), among those matching the
    fixed values given. Returns (shape, predicted speedup)."""
    candidates = [s for s in profile.tau
                  if (total_token is None or s[0] == total_token) and (depth is None or s[1] == depth)
                  and (branching is None or s[2] == branching) and (draft_vocab is None or s[3] == draft_vocab)
                  and s[0] in profile.verify_ms
                  and (s[2], s[3]) in profile.level_ms and s[3] in profile.extend_ms]
    if not candidates:
        raise ValueError(f"no measured tree shape has total_token={total_token}, depth={depth}, top_k={branching}, "
                         f"draft_vocab={draft_vocab}; measured sizes {sorted(profile.verify_ms)}, top_k "
                         f"{sorted({k for k, _ in profile.level_ms})}, depth 1..{max(s[1] for s in profile.tau)}, "
                         f"draft vocabularies {sorted(profile.extend_ms)}: pick from those or re-run `eagle-fsd tune`")
    best = max(candidates, key=lambda s: (profile.speedup(s), -s[0], -s[1], -s[2], s[3]))
    return best, profile.speedup(best)


def workload_speedup(prefill_ms: float, draft_prefill_ms: float, plain_ms: float, spec_ms: float,
                     prompt_tokens: float, new_tokens: float) -> float:
    """(P t_prefill + N t_plain) / (P (t_prefill + t_draft_prefill) + N t_spec), t_spec = t_step / E[a + 1]."""
    plain = prompt_tokens * prefill_ms + new_tokens * plain_ms
    return plain / (prompt_tokens * (prefill_ms + draft_prefill_ms) + new_tokens * spec_ms)


def nondecreasing(costs: dict[int, float]) -> dict[int, float]:
    """The least-squares non-decreasing fit of `costs` over their sorted keys (pool adjacent violators). A forward
    over n + 1 tokens does all the work of one over n and more, so where timings fall as n grows that is noise: the
    neighbours they contradict are pooled to their mean (t_verify(1), the denominator of every ratio, most of all)."""
    pools = []  # [mean, count] per run of pooled keys
    for key in sorted(costs):
        pools.append([costs[key], 1])
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            mean, count = pools.pop()
            before = pools[-1]
            before[0], before[1] = (before[0] * before[1] + mean * count) / (before[1] + count), before[1] + count
    return dict(zip(sorted(costs), (mean for mean, count in pools for _ in range(count))))


@dataclass
class Tuning:
    """What the engine uses: the chosen shape, whether to speculate at all, and the plain rate for the guard."""

    shape: Shape                           # total_token, depth, branching, draft vocabulary size (0: full)
    predicted_speedup: float
    plain_ms: float                        # the profile's t_plain and t_verify(n): the speed guard's yardstick
    verify_ms: dict[int, float]
    speculate: bool
    path: str = ""
    spec_ms: float = 0.0                   # t_step / E[a + 1] of the shape: ms per token while speculating
    prefill_ms: float = 0.0                # per prompt token, target and drafter (CostProfile)
    draft_prefill_ms: float = 0.0
    profile: CostProfile | None = None     # what the tree was chosen from (a rule's tree is chosen from it too)

    @property
    def tree(self) -> TreeShape:
        """The chosen shape, as the engine takes it."""
        return TreeShape(*self.shape)

    def workload_speedup(self, prompt_tokens: float, new_tokens: float) -> float:
        """The predicted speedup over plain decoding of whole generations (prompt and new tokens summed)."""
        return workload_speedup(self.prefill_ms, self.draft_prefill_ms, self.plain_ms, self.spec_ms, prompt_tokens,
                                new_tokens)


def tuning_from(profile: CostProfile, fixed: dict, path: str = "") -> Tuning:
    shape, speedup = choose_shape(profile, **fixed)
    return Tuning(tuple(shape), speedup, profile.plain_ms, dict(profile.verify_ms), speculate=speedup > 1.0,
                  path=path, spec_ms=profile.step_ms(shape) / profile.tau[shape], prefill_ms=profile.prefill_ms,
                  draft_prefill_ms=profile.draft_prefill_ms, profile=profile)


def describe(tuning: Tuning) -> str:
    n, d, k, v = tuning.shape
    tree = f"tree (total_token, depth, top_k) = ({n}, {d}, {k}), draft vocabulary {v or 'full'}"
    if tuning.speculate:
        return f"{tree}; predicted {tuning.predicted_speedup:.2f}x plain decoding"
    return (f"plain decoding: the best {tree} is predicted at {tuning.predicted_speedup:.2f}x, slower than plain "
            "(speculation is probed after 32 plain tokens, and kept where it measures faster)")
