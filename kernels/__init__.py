"""Triton kernels: tree attention and fused divergences, each with a float64 torch reference.

Self-contained: nothing here imports the rest of eagle_fsd (FSD checks that the names in FUSED_DIVERGENCES are among
its own). Importing this package builds the Triton kernels; on a machine without CUDA set ``TRITON_INTERPRET=1`` first
(tests/conftest.py does) so they run in the Triton CPU interpreter.

This folder is the package eagle_fsd.kernels. Run from the repository root (`python -m ...`, `python -c`, a notebook)
Python also finds it as a top-level `kernels`, the name of Hugging Face's kernels package, which transformers >= 5.25
depends on and imports; imported under that name, this file hands the import over to that package where it is
installed (`_installed_kernels`), and is itself otherwise (what transformers < 5.25 finds and then ignores).
"""


def _installed_kernels():
    """The spec of a top-level `kernels` found past the repository root (None: not installed)."""
    import importlib.machinery
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [path for path in sys.path if os.path.abspath(path or os.curdir) != root]
    return importlib.machinery.PathFinder.find_spec("kernels", elsewhere)


def _load_in_place(spec) -> None:
    import importlib.util
    import sys

    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # what the import statement returns once this file has run
    spec.loader.exec_module(module)


_installed = _installed_kernels() if __name__ == "kernels" else None
if _installed is not None:
    _load_in_place(_installed)
else:
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
