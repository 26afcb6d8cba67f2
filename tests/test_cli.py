"""The `eagle-fsd` command end to end on the real SmolLM2 preset (drafting for itself: a valid, fast drafter)."""
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def eagle_fsd(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "eagle_fsd.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_run_reports_what_it_measured():
    """The figures `run` prints agree with each other: the rate is tokens / seconds, tau lies within what a tree of
    8 nodes can give and accounts for the tokens over the steps, the speedup is the ratio of the two rates, and in
    fp32 greedy the output is HF generate's, token for token (as many tokens)."""
    r = eagle_fsd("run", "--model", "smollm2-135m-instruct", "--drafter", "smollm2-135m-instruct", "--dtype", "fp32",
                  "--max-new-tokens", "24", "--total-token", "8", "--depth", "3", "--top-k", "2", "--prompt", "Say hello.")
    assert r.returncode == 0, r.stderr
    ours = re.search(r"eagle-fsd: (\d+) tokens in ([\d.]+) s = ([\d.]+) tokens/s, tau = ([\d.]+) tokens per target "
                     r"forward \((\d+) verification steps\)", r.stdout)
    hf = re.search(r"HF generate: (\d+) tokens in ([\d.]+) s = ([\d.]+) tokens/s", r.stdout)
    speedup = re.search(r"speedup: +([\d.]+)x \((.*)\)", r.stdout)
    assert ours and hf and speedup, r.stdout
    tokens, seconds, rate, tau, steps = (float(x) for x in ours.groups())
    assert 0 < tokens <= 24 and tokens == float(hf.group(1))
    assert rate == pytest.approx(tokens / seconds, rel=0.02)
    assert 1.0 <= tau <= 8.0 and tokens - 1 <= tau * steps + 0.01 * steps  # the first token comes from prefill
    assert float(speedup.group(1)) == pytest.approx(rate / float(hf.group(3)), rel=0.02, abs=0.01)
    assert speedup.group(2) == "identical output"


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
