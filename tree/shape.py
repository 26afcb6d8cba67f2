"""The shape of a draft tree, a value chosen once (by the caller, the loader or the tuner) and passed along."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TreeShape:
    """A tree of `total_token` nodes (the root included), the best of a pool grown by `depth` draft forwards of
    `branching` nodes each (EAGLE's total_token, depth and top_k), the drafter scoring the `draft_vocab` most
    frequent tokens (0: its own whole vocabulary). A drafting step reads at most total_token tokens; the pool holds
    branching + depth * branching^2 nodes."""

    total_token: int
    depth: int
    branching: int
    draft_vocab: int = 0

    def __post_init__(self):
        for name, value in (("total_token", self.total_token), ("depth", self.depth), ("branching", self.branching)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"tree {name}={value!r} must be a positive int (EAGLE's total_token, depth, top_k; "
                                 "its defaults: total_token=60, depth=5, top_k=10)")
        if not isinstance(self.draft_vocab, int) or self.draft_vocab < 0:
            raise ValueError(f"draft_vocab={self.draft_vocab!r} must be an int >= 0 (0: the drafter's own vocabulary)")

    @property
    def level_room(self) -> int:
        """Cache entries the tree levels take in the drafter beyond its context: depth levels of branching nodes."""
        return self.depth * self.branching

    def eagle(self) -> tuple[int, int, int]:
        """(total_token, depth, top_k), EAGLE's names."""
        return self.total_token, self.depth, self.branching
