"""eagle-fsd: EAGLE-2 dynamic-tree speculative decoding with fuzzy (FSD) acceptance."""

__all__ = ["EaFsdModel", "FsdConfig", "GenerateOutput", "TreeShape"]


def __getattr__(name):  # lazy: `eagle-fsd models ...` should not pay for importing transformers
    if name in ("EaFsdModel", "GenerateOutput"):
        from eagle_fsd import model

        return getattr(model, name)
    if name == "FsdConfig":
        from eagle_fsd.fsd import FsdConfig

        return FsdConfig
    if name == "TreeShape":
        from eagle_fsd.tree.shape import TreeShape

        return TreeShape
    raise AttributeError(f"module 'eagle_fsd' has no attribute {name!r}")
