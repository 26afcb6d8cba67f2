"""The float dtypes by name: the short names of the command lines and torch's own names (what configs store)."""
from __future__ import annotations

import torch

# short name -> dtype, in the order the command lines list them
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# torch's name ("float32", "bfloat16", "float16") -> dtype
LONG_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in DTYPES.values()}


def torch_dtype(name: str) -> torch.dtype:
    """The dtype of a short ("bf16") or long ("bfloat16") name."""
    dtype = DTYPES.get(name) or LONG_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join([*DTYPES, *LONG_DTYPES])}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of a dtype: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")
