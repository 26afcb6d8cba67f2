"""What the generation loop calls beside the algorithm, behind one interface (StepPolicy): the draft tree of the
call's acceptance rule, whether a step speculates (the speed guard), the phase clock, and the call's statistics
(GenerateOutput)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eagle_fsd.guard import PhaseClock, SpeedGuard
from eagle_fsd.tree.accept import Step, acceptance_by_depth, tokens_per_step
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tune.follow import ShapeFollower


@dataclass
class GenerateOutput:
    sequences: torch.Tensor                  # (1, prompt + new) token ids, like HF generate
    new_tokens: int = 0
    verify_steps: int = 0                    # target forwards after prefill (one per step)
    accept_lengths: list[int] = field(default_factory=list)  # accepted draft tokens per step (bonus excluded)
    fuzzy_accepts: list[int] = field(default_factory=list)   # of those, accepted only by the FSD rule
    divergences: list[list[float]] = field(default_factory=list)  # per step, D at each visited node with children
    fuzzy_mask: list[bool] = field(default_factory=list)     # per new token: accepted only by the FSD rule
    wall_time: float = 0.0
    plain_steps: int = 0                     # steps decoded without a draft (the speed guard's fallback)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # draft / verify / accept / cache / other
    tree_steps: dict[str, int] = field(default_factory=dict)  # speculative steps per draft tree "n/d/k[/v]"
    tree_switches: int = 0                   # times the rule's tree was re-chosen during the call (ShapeFollower)

    @property
    def fell_back(self) -> bool:
        """True when some tokens were decoded plainly because speculation did not pay (see SpeedGuard)."""
        return self.plain_steps > 0

    @property
    def tau(self) -> float:
        """Mean tokens per verification forward, bonus token included (SGLang/vLLM/EAGLE convention)."""
        return tokens_per_step(sum(self.accept_lengths), len(self.accept_lengths))

    @property
    def fuzzy_fraction(self) -> float:
        """Share of the accepted draft tokens that only the FSD rule accepted."""
        return sum(self.fuzzy_accepts) / max(sum(self.accept_lengths), 1)

    def acceptance_by_depth(self) -> list[float]:
        """[d-1] = P(a draft token at depth d is accepted | its parent was), over all steps."""
        return acceptance_by_depth(self.accept_lengths)

    def record(self, step: Step, plain: bool) -> None:
        """Add one verification step's statistics (its tokens are emitted by the loop)."""
        self.accept_lengths.append(step.accept_length)
        self.fuzzy_accepts.append(step.fuzzy)
        self.divergences.append(step.divergences)
        self.plain_steps += plain

    def finish(self, input_ids: torch.Tensor, generated: list[int], seconds: float, phase_seconds: dict) -> None:
        new_ids = torch.tensor([generated], dtype=input_ids.dtype, device=input_ids.device)
        self.sequences = torch.cat([input_ids, new_ids], dim=1)
        self.new_tokens, self.verify_steps = len(generated), len(self.accept_lengths)
        self.wall_time, self.phase_seconds = seconds, phase_seconds


def tree_label(shape: TreeShape) -> str:
    """TreeShape(5, 3, 1, 37888) -> "5/3/1/37888" (no "/v" for the drafter's whole vocabulary)."""
    return "/".join(map(str, shape.eagle() + ((shape.draft_vocab,) if shape.draft_vocab else ())))


class StepPolicy:
    """One call's policy and bookkeeping. trees: the call's rule's ShapeFollower (its draft tree, re-chosen from the
    acceptance it measures; a fixed tree: ShapeFollower(None, shape)); guard: the rule's speed guard (SpeedGuard(None):
    off); speculative: the call has a drafter (plain decoding has none, and no plain steps are counted for it);
    profile: synchronise the clock's laps on CUDA."""

    def __init__(self, trees: ShapeFollower, guard: SpeedGuard, speculative: bool, profile: bool = False):
        self.trees, self.guard, self.speculative, self.profile = trees, guard, speculative, profile
        self.start = time.perf_counter()  # the call's wall time counts from here, the prompt's prefill included
        self.clock, self.step_start, self.verify_seconds = None, self.start, 0.0

    @property
    def shape(self) -> TreeShape:
        """The tree the next step drafts."""
        return self.trees.shape

    @property
    def room(self) -> TreeShape:
        """A tree whose cache room covers every tree this call may draft."""
        return self.trees.room

    def start_steps(self) -> None:
        """The phase clock starts after the prefill: phase_seconds are the steps' time (the target's prefill is a
        call's cost, not a step's)."""
        self.clock = PhaseClock(sync=self.profile)
        self.step_start = self.clock.last

    def speculate(self) -> bool:
        """Whether the next step drafts a tree (else the root alone)."""
        return self.speculative and self.guard.speculate()

    def begin_step(self) -> None:
        self.step_start = self.clock.last

    def lap(self, phase: str) -> float:
        """Charge the time since the last lap to `phase`; the seconds charged (a verification's are the guard's)."""
        before = self.clock.last
        self.clock.lap(phase)
        seconds = self.clock.last - before
        if phase == "verify":
            self.verify_seconds = seconds
        return seconds

    def record(self, out: GenerateOutput, step: Step, tree_size: int, speculated: bool) -> None:
        """A finished step: its statistics in `out`, and its time for the guard."""
        out.record(step, plain=self.speculative and not speculated)
        if self.speculative and speculated:
            label = tree_label(self.shape)
            out.tree_steps[label] = out.tree_steps.get(label, 0) + 1
            out.tree_switches += self.trees.record(step.accept_length)
        self.guard.record(speculated, len(step.tokens), self.clock.last - self.step_start, self.verify_seconds,
                          tree_size)

    def finish(self, out: GenerateOutput, input_ids: torch.Tensor, generated: list[int]) -> GenerateOutput:
        out.finish(input_ids, generated, time.perf_counter() - self.start, self.clock.seconds)
        return out
