"""The `eagle-fsd` command end to end on the real SmolLM2 preset (drafting for itself: a valid, fast drafter)."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def eagle_fsd(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "eagle_fsd.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_run_prints_speed_tau_and_speedup():
    r = eagle_fsd("run", "--model", "smollm2-135m-instruct", "--drafter", "smollm2-135m-instruct", "--dtype", "fp32",
                  "--max-new-tokens", "24", "--total-token", "8", "--top-k", "2", "--prompt", "Say hello.")
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout and "tau = " in r.stdout
    assert "speedup:" in r.stdout and "(identical output)" in r.stdout


def test_run_rejects_bad_arguments_clearly():
    r = eagle_fsd("run", "--model", "smollm2-135m-instruct", "--drafter", "smollm2-135m-instruct",
                  "--fsd-threshold", "-1", "--max-new-tokens", "4")
    assert r.returncode == 2 and "fsd_threshold=-1.0 must be a number >= 0" in r.stderr
    assert "Traceback" not in r.stderr


def test_help_and_unknown_command():
    assert eagle_fsd("--help").returncode == 0
    r = eagle_fsd("nope")
    assert r.returncode == 2 and "commands:" in r.stdout


def test_output_agreement_says_where_and_why():
    import torch

    from eagle_fsd.cli import output_agreement

    ref = torch.tensor([[7, 7, 1, 2, 3, 4]])  # a 2-token prompt, then 4 new tokens
    other = torch.tensor([[7, 7, 1, 2, 9, 4]])
    assert output_agreement(ref, ref.clone(), 2, torch.bfloat16, False) == "identical output"
    bf16 = output_agreement(ref, other, 2, torch.bfloat16, False)
    assert bf16.startswith("output differs from new token 3 on") and "--dtype fp32" in bf16
    assert "unexpected" in output_agreement(ref, other, 2, torch.float32, False)
    assert "by chance" in output_agreement(ref, other, 2, torch.float32, True)
    assert "FSD" in output_agreement(ref, other, 2, torch.bfloat16, False, fuzzy=True)
    assert "new token 4 on" in output_agreement(ref, ref[:, :-1], 2, torch.bfloat16, False)  # one stopped early
