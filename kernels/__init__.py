"""Triton kernels: tree attention and fused divergences, each with a float64 torch reference.

Self-contained: nothing here imports the rest of eagle_fsd (FSD checks that the names in FUSED_DIVERGENCES are among
its own). Importing this package builds the Triton kernels; on a machine without CUDA set ``TRITON_INTERPRET=1`` first
(tests/conftest.py does) so they run in the Triton CPU interpreter.
"""

from .divergence import FUSED_DIVERGENCES, divergence_reference, fused_divergence, fused_divergence_available
from .tree_attention import (
    is_interpreting,
    kernel_available,
    pack_tree_mask,
    tree_attention,
    tree_attention_reference,
    unpack_tree_mask,
)

__all__ = [
    "tree_attention",
    "tree_attention_reference",
    "pack_tree_mask",
    "unpack_tree_mask",
    "is_interpreting",
    "kernel_available",
    "fused_divergence",
    "fused_divergence_available",
    "divergence_reference",
    "FUSED_DIVERGENCES",
]
