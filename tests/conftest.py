import os

import pytest
import torch

# Triton kernels run on CPU only in interpreter mode, which must be chosen before any @triton.jit decorator runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The tuner's busy-machine check (eagle_fsd.tune.trust) sees a quiet machine in every test, whatever else runs
    on the test machine; a test of the check sets other clocks."""
    from eagle_fsd.tune.trust import TimingWatch
    from tiny import machine_clocks

    monkeypatch.setattr(TimingWatch, "clocks", staticmethod(machine_clocks(1.0)))


@pytest.fixture(autouse=True)
def kernel_races_in_tmp(tmp_path, monkeypatch):
    """Kernel timings (eagle_fsd.tune.dtype.raced_ms) are kept in the test's own folder: a fake timing never
    reaches the machine's cache, and none found there decides a test."""
    from eagle_fsd.tune import dtype as tune_dtype

    monkeypatch.setattr(tune_dtype, "race_path", lambda: tmp_path / "kernel_races.json")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: intra-op threads only add contention (a 30-token generate goes from ~0.5 s to ~10 s on a busy
    2-core box with the default thread count). Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from eagle_fsd import presets

    if not presets.is_fetched("smollm2-135m-instruct"):
        pytest.skip("needs the SmolLM2 preset's tokenizer: eagle-fsd models fetch smollm2-135m-instruct")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(presets.resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def tiny_chat_model(smollm2_tokenizer):
    """A tiny random target drafting for itself (whole paths accepted: tau > 1), with SmolLM2's tokenizer and chat
    template, for the harness commands."""
    from eagle_fsd.drafting import LMDrafter
    from eagle_fsd.model import EaFsdModel
    from tiny import tiny_model

    vocab = 49152  # SmolLM2's
    target = tiny_model(vocab=vocab, seed=1, max_position_embeddings=4096)
    return EaFsdModel(target, smollm2_tokenizer, LMDrafter(target, vocab), total_token=8, depth=3, top_k=2)
