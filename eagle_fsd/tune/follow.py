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
the one rate that makes E[a + 1 | shape, 0] the profile's own for that shape. A rule's f comes from the per-rule
replay (eagle_fsd.tune.rule_replay) before it has run, and from the acceptance it measures while it runs
(fit_rescue: the f whose predicted E[a] on the running shape is the observed one). The tree is the argmax of
E[a + 1 | shape, f] t_plain / t_step(shape), over shapes of one draft vocabulary.
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
    branching and draft vocabulary, moved by the one rate that makes E[a + 1] the profile's own for this shape
    (so f = 0 gives the profile back)."""
    n, d, k, v = shape
    depth = levels(shape)
    alpha = list(profile.acceptance_by_depth.get((k, v), []))[:depth]
    alpha += [alpha[-1] if alpha else 0.5] * (depth - len(alpha))
    return [move(a, fit_rescue(alpha, profile.tau[shape] - 1.0)) for a in alpha]


def rule_tau(alpha0: list[float], rescue: float) -> float:
    """E[a + 1] with each depth's lossless acceptance alpha0 moved by the rescue rate (module docstring)."""
    tau, survive = 1.0, 1.0
    for a in alpha0:
        survive *= move(a, rescue)
        tau += survive
    return tau


def fit_rescue(alpha0: list[float], mean_accepted: float, iterations: int = 40) -> float:
    """The f in [-1, 1] whose E[a] = rule_tau - 1 equals `mean_accepted` (bisection: E[a] grows with f); the
    nearest end where it is out of reach (every draft accepted: f = 1)."""
    low, high = -1.0, 1.0
    for _ in range(iterations):
        mid = (low + high) / 2
        if rule_tau(alpha0, mid) - 1.0 < mean_accepted:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def predicted_speedup(profile: CostProfile, shape: Shape, rescue: float) -> float:
    """E[a + 1 | shape, f] t_plain / t_step(shape)."""
    return rule_tau(lossless_acceptance(profile, shape), rescue) * profile.plain_ms / profile.step_ms(shape)


def candidate_shapes(profile: CostProfile, draft_vocab: int) -> list[Shape]:
    """The shapes the profile can cost, of one draft vocabulary (a switch keeps the drafter's vocabulary)."""
    return [s for s in profile.tau if s[3] == draft_vocab and s[0] in profile.verify_ms
            and (s[2], s[3]) in profile.level_ms and s[3] in profile.extend_ms]


def best_shape(profile: CostProfile, rescue: float, draft_vocab: int) -> tuple[Shape, float]:
    """The fastest predicted shape for rescue rate f (ties: the smaller tree) and its predicted speedup."""
    best = max(candidate_shapes(profile, draft_vocab),
               key=lambda s: (predicted_speedup(profile, s, rescue), -s[0], -s[1], -s[2]))
    return best, predicted_speedup(profile, best, rescue)


class ShapeFollower:
    """One rule's tree, re-chosen from the acceptance the rule measures on it. Every `every` speculative steps the
    rescue rate is fitted to the mean accepted length of the last `window` steps on the running tree (at least
    `min_steps` of them) and the fastest predicted shape replaces the running one only when it is predicted at least
    `margin` faster: noise around a choice does not flip it. profile None: the shape is fixed."""

    def __init__(self, profile: CostProfile | None, shape: TreeShape, rescue: float = 0.0, every: int = 16,
                 window: int = 64, min_steps: int = 32, margin: float = 0.05):
        self.profile, self.shape, self.rescue = profile, shape, rescue
        self.every, self.min_steps, self.margin = every, min_steps, margin
        self.accepted: deque[int] = deque(maxlen=window)  # accepted lengths on the running tree
        self.switches, self.since_check = 0, 0

    @property
    def room(self) -> TreeShape:
        """A shape whose cache room covers every shape the follower may switch to (a call sizes its caches once)."""
        if self.profile is None:
            return self.shape
        shapes = candidate_shapes(self.profile, self.shape.draft_vocab) + [self._key(self.shape)]
        return TreeShape(max(s[0] for s in shapes), max(s[1] for s in shapes), max(s[2] for s in shapes),
                         self.shape.draft_vocab)

    @staticmethod
    def _key(shape: TreeShape) -> Shape:
        return shape.total_token, shape.depth, shape.branching, shape.draft_vocab

    def record(self, accepted: int) -> bool:
        """A speculative step's accepted length on the running tree; True when the tree was switched."""
        if self.profile is None:
            return False
        self.accepted.append(accepted)
        self.since_check += 1
        if self.since_check < self.every or len(self.accepted) < self.min_steps:
            return False
        self.since_check = 0
        current = self._key(self.shape)
        if current not in self.profile.tau:
            return False
        alpha0 = lossless_acceptance(self.profile, current)
        self.rescue = fit_rescue(alpha0, sum(self.accepted) / len(self.accepted))
        best, speedup = best_shape(self.profile, self.rescue, self.shape.draft_vocab)
        if best == current or speedup < predicted_speedup(self.profile, current, self.rescue) * (1 + self.margin):
            return False
        self.shape = TreeShape(*best)
        self.accepted.clear()
        self.switches += 1
        return True


def rule_prediction(profile: CostProfile, shape: TreeShape, rescue: float) -> dict:
    """What the cost model predicts for a rule on `shape` at rescue rate f: E[a + 1], t_step and the speedup over
    plain decoding per new token (prefill aside)."""
    key = ShapeFollower._key(shape)
    tau = rule_tau(lossless_acceptance(profile, key), rescue)
    step = profile.step_ms(key)
    return {"tau": tau, "step_ms": step, "speedup_per_token": tau * profile.plain_ms / step}
