"""Timing of the generation loop: wall time per phase, and the guard that keeps speculation from running slower
than plain decoding."""
from __future__ import annotations

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


class SpeedGuard:
    """Never slower than plain decoding. Each step's target forward is timed, and the cost profile's t_verify(n)
    and t_plain turn that into what plain decoding would cost right now, whatever else loads the machine:
        plain_equivalent(step) = tokens * t_plain * (measured verify time / t_verify(n)).
    When the last `window` speculative steps took `margin` longer than their plain equivalent, the next `backoff`
    tokens are decoded plainly, then speculation is tried again (the backoff doubles each time it loses). The
    window and margin keep a few unlucky steps of a speculation that pays on average from switching it off.
    plain_ms None disables the guard. start_plain: begin in plain mode (the cost model predicts a loss).
    The profile's t_plain is only the starting point: once plain steps have run, t_plain is what they measured,
    brought to the profile's machine speed (seconds / slowdown), so a profile that misjudges plain decoding or
    verification heals within a generation (plain steps are timed the same way as speculative ones)."""

    def __init__(self, plain_ms: float | None = None, verify_ms: dict[int, float] | None = None, window: int = 16,
                 backoff: int = 32, start_plain: bool = False, margin: float = 0.05):
        self.plain_ms, self.verify_ms = plain_ms, verify_ms or {}
        self.window, self.backoff, self.margin = window, backoff, margin
        self.recent: deque[tuple[float, float]] = deque(maxlen=window)  # (seconds, plain-equivalent seconds)
        self.plain_seen: deque[tuple[float, int, float]] = deque(maxlen=64)  # (seconds, tokens, tokens x slowdown)
        self.plain_left = backoff if start_plain and plain_ms is not None else 0

    MIN_PLAIN_TOKENS = 8  # plain tokens measured before their rate replaces the profile's

    def plain_seconds(self) -> float:
        """t_plain at the profile's machine speed, in seconds: measured by the plain steps seen, else the profile's."""
        if sum(t for _, t, _ in self.plain_seen) < self.MIN_PLAIN_TOKENS:
            return self.plain_ms / 1000
        return sum(s for s, _, _ in self.plain_seen) / sum(w for _, _, w in self.plain_seen)

    def speculate(self) -> bool:
        return self.plain_left <= 0

    def _slowdown(self, verify_seconds: float, tree_size: int) -> float:
        """Measured / profiled verification time: how much slower the machine runs now than when tuned."""
        if not self.verify_ms:
            return 1.0
        n = min(self.verify_ms, key=lambda m: (abs(m - tree_size), m))
        return 1000 * verify_seconds / self.verify_ms[n] * (n / tree_size if n > tree_size else 1.0)

    def record(self, speculative: bool, tokens: int, seconds: float, verify_seconds: float = 0.0,
               tree_size: int = 1) -> None:
        if self.plain_ms is None:
            return
        if not speculative:
            self.plain_left -= tokens
            if verify_seconds > 0:
                self.plain_seen.append((seconds, tokens, tokens * self._slowdown(verify_seconds, tree_size)))
            return
        plain_equivalent = tokens * self.plain_seconds() * self._slowdown(verify_seconds, tree_size)
        self.recent.append((seconds, plain_equivalent))
        if (len(self.recent) == self.window
                and sum(s for s, _ in self.recent) > (1 + self.margin) * sum(p for _, p in self.recent)):
            self.plain_left, self.backoff = self.backoff, 2 * self.backoff
            self.recent.clear()
