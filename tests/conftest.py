import os

import pytest
import torch

# Triton kernels run on CPU only in interpreter mode, which must be chosen before any @triton.jit decorator runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: intra-op threads only add contention (a 30-token generate goes from ~0.5 s to ~10 s on a busy
    2-core box with the default thread count). Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
