"""Timing of the generation loop: wall time per phase, and the guard that keeps speculation from running slower
than plain decoding."""
from __future__ import annotations

import statistics
import time
from collections import deque

import torch


class PhaseClock:
    """Wall time per phase of the loop: lap(name) charges the time since the previous lap to `name`.
    On CUDA the laps synchronise only when asked to (profiling), so that timing never slows a normal run."""

    def __init__(self, sync: bool = False):
        self.seconds: dict[str, float] = {}
        self.sync = sync and torch.cuda.is_available()
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now


class GuardMemory:
    """What a model's speed guards measured, shared by them (one guard per acceptance rule) and kept for the model's
    life: the plain steps' rates and each tree size's verification times."""

    def __init__(self, size: int = 64):
        self.plain_seen: deque[tuple[float, int, float]] = deque(maxlen=size)  # (seconds, tokens, tokens x slowdown)
        self.verify_seen: dict[int, deque[float]] = {}                        # tree size -> verify seconds
        self.size = size

    def saw_verify(self, tree_size: int, seconds: float) -> None:
        self.verify_seen.setdefault(tree_size, deque(maxlen=self.size)).append(seconds)


class SpeedGuard:
    """At worst about as fast as plain decoding (its aim: never slower). Each step's target forward is timed, and
    the cost profile's t_verify(n) and t_plain turn that into what plain decoding would cost right now, whatever else
    loads the machine:
        plain_equivalent(step) = tokens * t_plain * (measured verify time / t_verify(n)).
    When the last `window` speculative steps took `margin` longer than their plain equivalent, the next `backoff`
    tokens are decoded plainly, then speculation is tried again (the backoff doubles each time it loses in a row).
    The window and margin keep a few unlucky steps of a speculation that pays on average from switching it off (on
    chat a 16-step window handed 32-224 of lossless' ~600 steps to plain decoding where speculation paid on every
    question; 32 steps: none, benchmarks/guard_window_ab.py).
    plain_ms None disables the guard. start_plain: begin in plain mode (the cost model predicts a loss).
    The profile is only the starting point; measurements heal it (plain and speculative steps are timed alike):
    - t_plain: once plain steps have run, what they measured, brought to the profile's machine speed
      (seconds / slowdown);
    - t_verify(n) / t_verify(1): once both sizes have run MIN_SAMPLES times, the ratio of their median measured
      verify times, so t_verify(n) = t_verify(1) * that ratio. A profile point that noise put 10 % low would
      otherwise make every speculative step look 10 % cheaper against plain decoding than it is.
    A model keeps one guard per acceptance rule (lossless and each FSD setting speculate differently) for its life,
    so its generate calls are judged as one long generation: a call that ends in a plain backoff hands the rest of
    it to the next call, and losses in a row across calls keep doubling the backoff, up to MAX_BACKOFF tokens (so
    speculation is still probed now and then). `memory` (a GuardMemory) holds the measurements the model's guards
    share."""

    def __init__(self, plain_ms: float | None = None, verify_ms: dict[int, float] | None = None, window: int = 32,
                 backoff: int = 32, start_plain: bool = False, margin: float = 0.05,
                 memory: GuardMemory | None = None):
        self.plain_ms, self.verify_ms = plain_ms, verify_ms or {}
        self.window, self.backoff, self.first_backoff, self.margin = window, backoff, backoff, margin
        self.recent: deque[tuple[float, int, float, int]] = deque(maxlen=window)  # (seconds, tokens, verify s, n)
        self.memory = memory or GuardMemory()
        self.plain_seen = self.memory.plain_seen
        self.plain_left = backoff if start_plain and plain_ms is not None else 0

    MIN_PLAIN_TOKENS = 8  # plain tokens measured before their rate replaces the profile's
    MIN_SAMPLES = 8  # verify times per size measured before their ratio replaces the profile's
    MAX_BACKOFF = 1024  # tokens

    def plain_seconds(self) -> float:
        """t_plain at the profile's machine speed, in seconds: measured by the plain steps seen, else the profile's."""
        if sum(t for _, t, _ in self.plain_seen) < self.MIN_PLAIN_TOKENS:
            return self.plain_ms / 1000
        return sum(s for s, _, _ in self.plain_seen) / sum(w for _, _, w in self.plain_seen)

    def speculate(self) -> bool:
        return self.plain_left <= 0

    def verify_reference_ms(self, tree_size: int) -> float:
        """t_verify(tree_size) at the profile's machine speed: t_verify(1) times the measured ratio of the two sizes'
        medians once both were seen enough, else the profile's (its nearest size, scaled down where larger)."""
        seen, plain = self.memory.verify_seen.get(tree_size, ()), self.memory.verify_seen.get(1, ())
        if tree_size != 1 and 1 in self.verify_ms and min(len(seen), len(plain)) >= self.MIN_SAMPLES:
            return self.verify_ms[1] * statistics.median(seen) / statistics.median(plain)
        n = min(self.verify_ms, key=lambda m: (abs(m - tree_size), m))
        return self.verify_ms[n] * (tree_size / n if n > tree_size else 1.0)

    def _slowdown(self, verify_seconds: float, tree_size: int) -> float:
        """Measured / reference verification time: how much slower the machine runs now than when tuned."""
        if not self.verify_ms:
            return 1.0
        return 1000 * verify_seconds / self.verify_reference_ms(tree_size)

    def record(self, speculative: bool, tokens: int, seconds: float, verify_seconds: float = 0.0,
               tree_size: int = 1) -> None:
        if self.plain_ms is None:
            return
        if verify_seconds > 0:
            self.memory.saw_verify(tree_size if speculative else 1, verify_seconds)
        if not speculative:
            self.plain_left -= tokens
            if verify_seconds > 0:
                self.plain_seen.append((seconds, tokens, tokens * self._slowdown(verify_seconds, 1)))
            return
        self.recent.append((seconds, tokens, verify_seconds, tree_size))
        if len(self.recent) < self.window:
            return
        # judged with what is known now: a window's early steps are not judged by a yardstick healed since
        plain_equivalent = sum(tokens * self._slowdown(verify, n) for _, tokens, verify, n in self.recent)
        losing = sum(s for s, *_ in self.recent) > (1 + self.margin) * self.plain_seconds() * plain_equivalent
        if losing:
            self.plain_left, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_BACKOFF)
            self.recent.clear()
        else:
            self.backoff = self.first_backoff
