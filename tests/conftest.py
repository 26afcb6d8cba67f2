import os

import torch

# Triton kernels run on CPU only in interpreter mode, which must be chosen before any @triton.jit decorator runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
