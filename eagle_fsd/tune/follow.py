"""The draft tree of an acceptance rule, and following it while generating (pure, over a CostProfile).

The profile's E[a + 1 | shape] is lossless acceptance on the calibration prompts. A rule that accepts more (FSD), or
work that the drafter predicts better or worse than those prompts, changes the acceptance at every depth. One number
describes the change: the rescue rate f, the share of the lossless rule's rejections that the rule accepts (f > 0),
or for f < 0 the share of its acceptances that are lost. Per depth L of a shape,

    alpha_L(f) = 1 - (1 - alpha0_L) (1 - f)      (f >= 0)
    alpha_L(f) = alpha0_L (1 + f)                (f < 0)
    E[a + 1 | shape, f] = 1 + sum_L prod_{i <= L} alpha_i(f),   L = 1 .. min(d + 1, n - 1)

(a tree of n nodes grown by d draft forwards holds an accepted chain of at most min(d + 1, n - 1) drafts). alpha0_L
is the profile's per-depth acceptance of the biggest tree of the shape's branching and draft vocabulary, moved by
the one rate that makes E[a + 1 | shape, 0] the profile's own for that shape. Chains deeper than the tuner replayed
(k = 1, d + 1 = n - 1 levels for each measured size n, up to twice the deepest replayed chain's size) are
candidates too, so that a rule accepting nearly every draft is not capped at the replayed depth: beyond the deepest
replayed depth, acceptance stays at the deepest rate, moved by the rate of the deepest replayed chain. A rule's f
comes from the per-rule replay (eagle_fsd.tune.rule_replay) before it has run, and from the acceptance it measures
while it runs (fit_rescue: the f whose predicted E[a] on the running shape is the observed one). The tree is the
argmax of E[a + 1 | shape, f] t_plain / t_step(shape), over shapes of one draft vocabulary, with the costs at the
call's mean context (CostProfile.at_context).
"""
from __future__ import annotations

from collections import deque

from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tune.profile import CostProfile, Shape


def levels(shape: Shape) -> int:
    """How deep an accepted chain can go in a tree of n nodes grown by d draft forwards: min(d + 1, n - 1)."""
    n, d, _, _ = shape
    return max(min(d + 1, n - 1), 0)


def move(alpha: float, rescue: float) -> float:
    """One depth's acceptance moved by rescue rate f (module docstring)."""
    return 1.0 - (1.0 - alpha) * (1.0 - rescue) if rescue >= 0 else alpha * (1.0 + rescue)


def lossless_acceptance(profile: CostProfile, shape: Shape) -> list[float]:
    """alpha0_L for L = 1 .. levels(shape): the profile's per-depth acceptance of the biggest tree of the shape's
    branching and draft vocabulary (beyond its deepest depth: that depth's rate), moved by the one rate that makes
    E[a + 1] the profile's own for this shape, or for a chain deeper than the replay that of the deepest replayed
    chain (so f = 0 gives the profile back)."""
    n, d, k, v = shape
    depth = levels(shape)
    alpha = list(profile.acceptance_by_depth.get((k, v), []))[:depth]
    alpha += [alpha[-1] if alpha else 0.5] * (depth - len(alpha))
    measured = shape if shape in profile.tau else deepest_replayed(profile, k, v)
    rate = fit_rescue(alpha[:levels(measured)], profile.tau[measured] - 1.0)
    return [move(a, rate) for a in alpha]


def deepest_replayed(profile: CostProfile, branching: int, draft_vocab: int) -> Shape:
    """The replayed shape of this branching and draft vocabulary that holds the longest chain (ties: the smaller)."""
    return max((s for s in profile.tau if s[2] == branching and s[3] == draft_vocab),
               key=lambda s: (levels(s), -s[0]))


def deeper_chains(profile: CostProfile, draft_vocab: int) -> list[Shape]:
    """Chains (n, n - 2, 1, v) deeper than the replay, one per measured verification size n up to twice the size
    of the deepest replayed chain (the extrapolated acceptance is trusted that far; a rule replayed at f = 1 would
    otherwise take the biggest size measured): each holds n - 1 levels, all of them drafted."""
    if (1, draft_vocab) not in profile.acceptance_by_depth or not any(
            s[2] == 1 and s[3] == draft_vocab for s in profile.tau):
        return []
    replayed = levels(deepest_replayed(profile, 1, draft_vocab))
    return [(n, n - 2, 1, draft_vocab) for n in sorted(profile.verify_ms) if replayed + 1 < n <= 2 * (replayed + 1)]


def rule_tau(alpha0: list[float], rescue: float) -> float:
    """E[a + 1] with each depth's lossless acceptance alpha0 moved by the rescue rate (module docstring)."""
    tau, survive = 1.0, 1.0
    for a in alpha0:
        survive *= move(a, rescue)
        tau += survive
    return tau


def fit_rescue(alpha0: list[float], mean_accepted: float) -> float:
    """The f in [-1, 1] whose E[a] = rule_tau - 1 equals `mean_accepted`; the nearest end where it is out of reach
    (every draft accepted: f = 1)."""
    return solve_rate(lambda f: rule_tau(alpha0, f) - 1.0, mean_accepted)


def fit_rescue_on_trees(profile: CostProfile, steps: dict[Shape, int], tokens_per_step: float) -> float:
    """The f whose E[a + 1], averaged over the trees a rule ran weighted by their steps, equals the tokens per step
    it measured: the acceptance it saw, in the model's terms (with it, a prediction judges the costs alone)."""
    tables, total = {s: lossless_acceptance(profile, s) for s in steps}, sum(steps.values())
    return solve_rate(lambda f: sum(count * rule_tau(tables[s], f) for s, count in steps.items()) / total,
                      tokens_per_step)


def solve_rate(grows, target: float, iterations: int = 40) -> float:
    """The f in [-1, 1] where the increasing function `grows` reaches `target` (bisection); the nearest end where it
    is out of reach."""
    low, high = -1.0, 1.0
    for _ in range(iterations):
        mid = (low + high) / 2
        if grows(mid) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def predicted_speedup(profile: CostProfile, shape: Shape, rescue: float, alpha0: list[float] | None = None) -> float:
    """E[a + 1 | shape, f] t_plain / t_step(shape); alpha0: lossless_acceptance(profile, shape) when known."""
    alpha0 = lossless_acceptance(profile, shape) if alpha0 is None else alpha0
    return rule_tau(alpha0, rescue) * profile.plain_ms / profile.step_ms(shape)


def candidate_shapes(profile: CostProfile, draft_vocab: int) -> list[Shape]:
    """The shapes the profile can cost, of one draft vocabulary (a switch keeps the drafter's vocabulary): the
    replayed ones and the deeper chains."""
    shapes = [s for s in profile.tau if s[3] == draft_vocab] + deeper_chains(profile, draft_vocab)
    return [s for s in shapes if s[0] in profile.verify_ms and (s[2], s[3]) in profile.level_ms
            and s[3] in profile.extend_ms]


def acceptance_table(profile: CostProfile, draft_vocab: int) -> dict[Shape, list[float]]:
    """alpha0 of every candidate shape of one draft vocabulary (a rule computes it once; its checks only move it)."""
    return {s: lossless_acceptance(profile, s) for s in candidate_shapes(profile, draft_vocab)}


def best_shape(profile: CostProfile, rescue: float, draft_vocab: int,
               table: dict[Shape, list[float]] | None = None) -> tuple[Shape, float]:
    """The fastest predicted shape for rescue rate f (ties: the smaller tree) and its predicted speedup; `table`:
    acceptance_table(profile, draft_vocab), computed here when not given."""
    table = acceptance_table(profile, draft_vocab) if table is None else table
    best = max(table, key=lambda s: (predicted_speedup(profile, s, rescue, table[s]), -s[0], -s[1], -s[2]))
    return best, predicted_speedup(profile, best, rescue, table[best])


def shape_key(shape: TreeShape) -> Shape:
    """The profile's key of a tree: (total_token, depth, branching, draft_vocab)."""
    return shape.total_token, shape.depth, shape.branching, shape.draft_vocab


class ShapeFollower:
    """One rule's tree, re-chosen from the acceptance the rule measures on it and the context a call runs at. Every
    `every` speculative steps the rescue rate is fitted to the mean accepted length of the last `window` steps on the
    running tree (at least `min_steps` of them); at a call's start the costs move to its mean context
    (`at_context`). Either way the fastest predicted shape replaces the running one only when it is predicted at
    least `margin` faster: noise around a choice does not flip it. profile None: the shape is fixed."""

    def __init__(self, profile: CostProfile | None, shape: TreeShape, rescue: float = 0.0, every: int = 16,
                 window: int = 64, min_steps: int = 32, margin: float = 0.05):
        self.profile, self.shape, self.rescue = profile, shape, rescue
        self.every, self.min_steps, self.margin = every, min_steps, margin
        self.accepted: deque[int] = deque(maxlen=window)  # accepted lengths on the running tree
        self.switches, self.since_check = 0, 0
        self.table = {} if profile is None else acceptance_table(profile, shape.draft_vocab)
        self.costs = profile  # the profile with its costs at the running call's context

    @property
    def room(self) -> TreeShape:
        """A shape whose cache room covers every shape the follower may switch to (a call sizes its caches once)."""
        shapes = list(self.table) + [shape_key(self.shape)]
        return TreeShape(max(s[0] for s in shapes), max(s[1] for s in shapes), max(s[2] for s in shapes),
                         self.shape.draft_vocab)

    def record(self, accepted: int) -> bool:
        """A speculative step's accepted length on the running tree; True when the tree was switched."""
        if self.profile is None:
            return False
        self.accepted.append(accepted)
        self.since_check += 1
        if self.since_check < self.every or len(self.accepted) < self.min_steps:
            return False
        self.since_check = 0
        current = shape_key(self.shape)
        if current not in self.table:
            return False
        self.rescue = fit_rescue(self.table[current], sum(self.accepted) / len(self.accepted))
        return self._choose()

    def at_context(self, tokens: float) -> bool:
        """A call whose steps run at `tokens` cached tokens on average: the costs move there (CostProfile.at_context)
        and the tree is chosen again at the rule's rescue rate. True when the tree was switched."""
        if self.profile is None:
            return False
        self.costs = self.profile.at_context(tokens)
        return shape_key(self.shape) in self.table and self._choose()

    def _choose(self) -> bool:
        """The fastest predicted shape at the current costs and rescue rate, when `margin` faster than the running
        one; True when it was switched to."""
        current = shape_key(self.shape)
        best, speedup = best_shape(self.costs, self.rescue, self.shape.draft_vocab, self.table)
        now = predicted_speedup(self.costs, current, self.rescue, self.table[current])
        if best == current or speedup < now * (1 + self.margin):
            return False
        self.shape = TreeShape(*best)
        self.accepted.clear()
        self.switches += 1
        return True


def trees_run_speedup(profile: CostProfile, steps: dict[Shape, int], rescue: float,
                      plain_steps: int = 0) -> float | None:
    """The speedup over plain decoding per new token predicted for the trees a rule ran, each for the steps it ran
    there, at rescue rate f, with the speed guard's plain steps (one token at t_plain each):
    (sum_s steps_s E[a + 1 | s, f] + plain_steps) t_plain / (sum_s steps_s t_step(s) + plain_steps t_plain).
    This judges the cost model on the trees that ran, apart from the follower's choice of them. None: a tree the
    profile cannot cost."""
    if not steps or any(s not in candidate_shapes(profile, s[3]) for s in steps):
        return None
    tokens = sum(count * rule_tau(lossless_acceptance(profile, s), rescue) for s, count in steps.items())
    drafted_ms = sum(count * profile.step_ms(s) for s, count in steps.items())
    return (tokens + plain_steps) * profile.plain_ms / (drafted_ms + plain_steps * profile.plain_ms)


def rule_prediction(profile: CostProfile, shape: TreeShape, rescue: float) -> dict:
    """What the cost model predicts for a rule on `shape` at rescue rate f: E[a + 1], t_step (and its terms:
    t_verify(n), the drafting and the loop's own work d t_level + t_extend + t_overhead), t_plain and the speedup over
    plain decoding per new token (prefill aside)."""
    key = shape_key(shape)
    tau = rule_tau(lossless_acceptance(profile, key), rescue)
    step = profile.step_ms(key)
    return {"tau": tau, "step_ms": step, "verify_ms": profile.verify_ms[key[0]],
            "drafting_ms": step - profile.verify_ms[key[0]], "plain_ms": profile.plain_ms,
            "speedup_per_token": tau * profile.plain_ms / step}
