"""Whether a machine was quiet enough for its timings to be cached. Other work on the CPU slows every timed term,
and a profile cached from such a run would mislead every later run, so each timing records two signs of a busy
machine:

    cpu share = process CPU seconds / (wall seconds x our threads)   (1: our threads had the cores to themselves)
    spread    = (p75 - p25) / median of one term's timed rounds        (the median over all terms)

A share under MIN_SHARE or a spread over MAX_SPREAD marks the timings as taken on a busy machine. The load average
(where the OS has one) is recorded beside them for the report; it lags by a minute and counts our own threads, so
it does not decide."""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

MIN_SHARE = 0.8
MAX_SPREAD = 0.25
CPU_CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # cap what a CPU may run


def relative_spread(samples: list[float]) -> float:
    """(p75 - p25) / median of the samples (0 for fewer than 4)."""
    if len(samples) < 4:
        return 0.0
    q1, median, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / median if median > 0 else 0.0


def load_per_core() -> float | None:
    """The 1-minute load average divided by the cores (None where the OS has no load average)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return None


@dataclass
class TimingWatch:
    """Accumulates the CPU share and the spread of every timing taken while it watches (see the module docstring).
    threads: the threads our timed work runs on (torch.get_num_threads()); cpu_share None when not on a CPU."""

    threads: int
    on_cpu: bool = True
    wall: float = 0.0
    cpu: float = 0.0
    spreads: list[float] = field(default_factory=list)  # one per timed term
    load: float | None = field(default_factory=load_per_core)

    @staticmethod
    def clocks() -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process: all its threads)."""
        return time.perf_counter(), time.process_time()

    def start(self) -> tuple[float, float]:
        return self.clocks()

    def stop(self, started: tuple[float, float], samples: dict[object, list[float]]) -> None:
        """Charge the time since `started` and the rounds of each timed term."""
        wall, cpu = self.clocks()
        self.wall += wall - started[0]
        self.cpu += cpu - started[1]
        self.spreads += [relative_spread(s) for s in samples.values()]

    @property
    def spread(self) -> float:
        return statistics.median(self.spreads) if self.spreads else 0.0

    @property
    def cpu_share(self) -> float | None:
        if not self.on_cpu or self.wall <= 0:
            return None
        return self.cpu / (self.wall * self.threads)

    def busy_reason(self) -> str | None:
        return busy_reason(self.cpu_share, self.spread, self.load)

    def conditions(self) -> dict:
        """What the profile file records about how its timings were taken."""
        share = self.cpu_share
        return {"measured_at": time.time(), "cpu_share": None if share is None else round(share, 3),
                "spread": round(self.spread, 3), "load_per_core": None if self.load is None else round(self.load, 2),
                "threads": self.threads, "busy": self.busy_reason()}


def busy_reason(cpu_share: float | None, spread: float, load: float | None = None) -> str | None:
    """Why timings with this CPU share and spread cannot be trusted, or None when they can."""
    reasons = []
    if cpu_share is not None and cpu_share < MIN_SHARE:
        reasons.append(f"our threads got {cpu_share:.0%} of their CPU time (other work shares the cores)")
    if spread > MAX_SPREAD:
        reasons.append(f"repeated timings varied by {spread:.0%} (p25 to p75)")
    if not reasons:
        return None
    if load is not None:
        reasons.append(f"load average {load:.1f} per core")
    return "; ".join(reasons)


def describe_age(seconds: float) -> str:
    """'3 minutes', '5 hours', '2 days'."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count > 1 else ''}"
    return "under a minute"
