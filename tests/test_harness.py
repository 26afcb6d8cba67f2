"""The evaluation harness: MT-Bench answers (FastChat schema, resume), the speed report's arithmetic, the quality/speed
sweep (CSV + PNG, resume), HumanEval sandboxed execution and GSM8K answer matching. Tiny random models with the real
SmolLM2 tokenizer (for its chat template)."""
import glob
import json
import os

import pytest
import torch

from eagle_fsd import presets
from eagle_fsd.drafting import LMDrafter
from eagle_fsd.eval import gsm8k, humaneval, mtbench, speed, sweep
from eagle_fsd.model import EaFsdModel
from eagle_fsd.tree.shape import TreeShape
from tiny import tiny_model

torch.set_num_threads(1)
VOCAB = 49152  # SmolLM2's
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Say hello.", "Now say it louder."]},
    {"question_id": 82, "category": "math", "turns": ["What is 2 + 2?", "And times 3?"]},
]


@pytest.fixture
def use_model(monkeypatch, tiny_chat_model):
    """Every harness command gets the tiny model instead of loading --model."""
    calls = []

    def fake_load(args):
        calls.append(args)
        return tiny_chat_model

    monkeypatch.setattr(mtbench, "load_model", fake_load)
    monkeypatch.setattr(sweep, "load_model", fake_load)
    return calls


# ---------------------------------------------------------------- MT-Bench answers
def fastchat_load_model_answers(answer_dir):
    """FastChat's loader (fastchat.llm_judge.common.load_model_answers) when importable (it needs openai and
    anthropic), else the same reading: every *.jsonl in the folder, model name = file name, lines by question_id."""
    try:
        from fastchat.llm_judge.common import load_model_answers

        return load_model_answers(answer_dir)
    except ImportError:
        answers = {}
        for filename in sorted(glob.glob(os.path.join(answer_dir, "*.jsonl"))):
            with open(filename) as f:
                lines = [json.loads(line) for line in f]
            answers[os.path.basename(filename)[:-6]] = {line["question_id"]: line for line in lines}
        return answers


def check_judge_fields(answer, n_turns):
    """What llm_judge's gen_judgment / show_result read of an answer line."""
    assert isinstance(answer["answer_id"], str) and answer["answer_id"]
    assert isinstance(answer["model_id"], str) and isinstance(answer["tstamp"], float)
    choice = answer["choices"][0]
    assert choice["index"] == 0
    assert len(choice["turns"]) == n_turns and all(isinstance(t, str) for t in choice["turns"])


def mtbench_argv(tmp_path, *extra):
    qfile = tmp_path / "question.jsonl"
    qfile.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return ["--model", "tiny", "--question-file", str(qfile), "--max-new-token", "12", "--model-id", "tiny-run",
            *extra]


def test_mtbench_answers_resume_and_speed(tmp_path, use_model, capsys):
    answers = tmp_path / "model_answer"
    run_file = answers / "tiny-run.jsonl"
    argv = mtbench_argv(tmp_path, "--answer-file", str(run_file))
    assert mtbench.main(argv + ["--limit", "1"]) == 0
    first = run_file.read_text().splitlines()
    assert len(first) == 1 and json.loads(first[0])["question_id"] == 81

    with pytest.raises(SystemExit, match="--resume"):  # never overwrites or appends to a file silently
        mtbench.main(argv)
    assert mtbench.main(argv + ["--resume"]) == 0
    lines = run_file.read_text().splitlines()
    assert lines[0] == first[0] and len(lines) == 2  # the finished answer is untouched, only 82 was added
    calls_before = len(use_model)
    assert mtbench.main(argv + ["--resume"]) == 0  # all done: the model is not even loaded
    assert len(use_model) == calls_before and "nothing to do" in capsys.readouterr().out

    loaded = fastchat_load_model_answers(str(answers))
    assert set(loaded) == {"tiny-run"} and set(loaded["tiny-run"]) == {81, 82}
    for answer in loaded["tiny-run"].values():
        check_judge_fields(answer, 2)
        choice = answer["choices"][0]
        for key in ("new_tokens", "verify_steps", "wall_time", "accept_lengths", "fuzzy_accepts", "idxs"):
            assert len(choice[key]) == 2, key
        for steps, lengths, tokens in zip(choice["verify_steps"], choice["accept_lengths"], choice["new_tokens"]):
            assert steps == len(lengths) and 0 < tokens <= 12
            assert tokens <= 1 + sum(a + 1 for a in lengths)  # prefill token + each step's tokens, cut at budget
        assert answer["eagle_fsd"]["method"] == "eagle-fsd"

    base_file = answers / "tiny-base.jsonl"
    assert mtbench.main(mtbench_argv(tmp_path, "--answer-file", str(base_file), "--baseline")) == 0
    base = [json.loads(line) for line in base_file.read_text().splitlines()]
    assert all(a == 0 for r in base for lengths in r["choices"][0]["accept_lengths"] for a in lengths)
    result = speed.report(run_file, base_file)
    assert result["questions"] == 2 and result["turns"] == 4 and result["tau"] > 1.0
    assert result["speedup"] > 0 and result["baseline"]["questions"] == 2
    capsys.readouterr()
    assert speed.main([str(run_file), "--baseline", str(base_file)]) == 0
    table = capsys.readouterr().out
    assert "speedup" in table and "tau" in table and "histogram" in table


def test_resume_refuses_other_settings(tmp_path, use_model):
    run_file = tmp_path / "a.jsonl"
    argv = mtbench_argv(tmp_path, "--answer-file", str(run_file), "--limit", "1")
    assert mtbench.main(argv) == 0
    with pytest.raises(SystemExit, match="fsd_threshold"):
        mtbench.main(argv + ["--resume", "--fsd-threshold", "0.5"])


def test_limit_and_range_select_the_same_questions_with_resume(tmp_path, use_model, monkeypatch):
    """A run killed after its first answer, then rerun with --resume, ends with the questions an uninterrupted run
    answers: --limit / --question-begin select, --resume only skips what is done."""
    qfile = tmp_path / "four.jsonl"
    qfile.write_text("".join(json.dumps({"question_id": 81 + i, "category": "writing", "turns": [f"Say {word}."]})
                             + "\n" for i, word in enumerate(["hi", "yes", "no", "ok"])))

    def run(path, *extra, kill_after=None):
        answer, calls = mtbench.answer_question, []

        def answer_or_die(*args):
            calls.append(args)
            if len(calls) > kill_after:
                raise KeyboardInterrupt  # Ctrl-C / kill while answering
            return answer(*args)

        if kill_after is not None:
            monkeypatch.setattr(mtbench, "answer_question", answer_or_die)
        try:
            return mtbench.main(["--model", "tiny", "--question-file", str(qfile), "--max-new-token", "4",
                                 "--model-id", "tiny-run", "--no-warmup", "--answer-file", str(path), *extra])
        finally:
            monkeypatch.setattr(mtbench, "answer_question", answer)

    def ids(path):
        return [json.loads(line)["question_id"] for line in path.read_text().splitlines()]

    for extra, expected in ((["--limit", "3"], [81, 82, 83]), (["--question-begin", "1", "--limit", "2"], [82, 83])):
        whole, part = tmp_path / f"whole{len(extra)}.jsonl", tmp_path / f"part{len(extra)}.jsonl"
        assert run(whole, *extra) == 0 and ids(whole) == expected
        assert run(part, *extra, kill_after=1) == 130 and ids(part) == expected[:1]
        assert run(part, *extra, "--resume") == 0
        assert ids(part) == expected, extra


def test_torn_last_line_is_repaired_on_resume(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text('{"question_id": 81}\n{"question_id": 8')  # killed in the middle of the second write
    assert [r["question_id"] for r in mtbench.read_answers(path)] == [81]
    assert path.read_text().endswith('8')  # reading alone changes nothing
    mtbench.read_answers(path, repair=True)
    assert path.read_text() == '{"question_id": 81}\n'
    path.write_text('{"question_id": 81}\nnot json\n{"question_id": 82}\n')
    with pytest.raises(ValueError, match="line 2"):  # damage in the middle is the user's to fix, not ours
        mtbench.read_answers(path, repair=True)


def test_default_model_id_and_answer_path():
    args = mtbench.parse_args(["--model", "qwen2.5-coder-1.5b-instruct", "--fsd-threshold", "0.5"])
    assert args.model_id == "qwen2.5-coder-1.5b-instruct-eagle-fsd-fsd-kl_qp-0.5-temperature-0"
    assert str(args.answer_file) == f"data/mt_bench/model_answer/{args.model_id}.jsonl"
    assert mtbench.parse_args(["--baseline"]).model_id.endswith("-baseline-temperature-0")


# ---------------------------------------------------------------- speed report arithmetic
def answer_line(qid, new_tokens, wall_time, accept_lengths=None, fuzzy=None, idxs=None):
    choice = {"index": 0, "turns": ["x"] * len(new_tokens), "new_tokens": new_tokens, "wall_time": wall_time}
    if accept_lengths is not None:
        choice.update(verify_steps=[len(a) for a in accept_lengths], accept_lengths=accept_lengths,
                      fuzzy_accepts=fuzzy)
    if idxs is not None:
        choice["idxs"] = idxs
    return json.dumps({"question_id": qid, "answer_id": "a", "model_id": "m", "choices": [choice], "tstamp": 0.0})


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_speed_math_on_known_answers(tmp_path, capsys):
    run = write_lines(tmp_path / "run.jsonl", [
        answer_line(1, [10, 6], [1.0, 1.0], [[2, 3, 1], [0, 4]], [[0, 1, 0], [0, 2]]),
        answer_line(2, [4], [2.0], [[2]], [[0]]),
    ])
    base = write_lines(tmp_path / "base.jsonl", [answer_line(1, [8, 8], [4.0, 4.0]), answer_line(3, [5], [1.0])])
    r = speed.report(run, base)
    assert r["new_tokens"] == 20 and r["tokens_per_s"] == pytest.approx(5.0)
    assert r["verify_steps"] == 6 and r["tau"] == pytest.approx((12 + 6) / 6)  # bonus token included
    # d1: 5 of 6 steps accept >= 1; d2: 4 of those 5 reach 2; d3: 2 of 4; d4: 1 of 2
    assert r["acceptance_by_depth"] == pytest.approx([5 / 6, 4 / 5, 2 / 4, 1 / 2])
    assert r["accept_length_histogram"] == {"0": 1, "1": 1, "2": 2, "3": 1, "4": 1}
    assert r["fuzzy_fraction"] == pytest.approx(3 / 12)
    # speedup over the one shared question: 16 tokens / 2 s against 16 tokens / 8 s
    assert r["speedup"] == pytest.approx(4.0) and r["baseline"]["questions"] == 1 and "note" in r["baseline"]

    assert speed.main([str(run), "--baseline", str(base), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["speedup"] == pytest.approx(4.0)


def test_speed_reads_eagle_answer_files(tmp_path):
    # EAGLE's gen_ea_answer_* files: no accept lengths; tau = sum(new_tokens) / sum(idxs + 1)
    run = write_lines(tmp_path / "eagle.jsonl", [answer_line(1, [10, 5], [1.0, 1.0], idxs=[3, 0])])
    r = speed.report(run)
    assert r["tau"] == pytest.approx(15 / 5) and "acceptance_by_depth" not in r


def test_speed_names_a_missing_field(tmp_path):
    path = tmp_path / "fastchat.jsonl"
    path.write_text(json.dumps({"question_id": 1, "choices": [{"index": 0, "turns": ["x"]}]}) + "\n")
    with pytest.raises(SystemExit, match="new_tokens"):
        speed.report(path)


# ---------------------------------------------------------------- sweep (the FSD frontier runner)
def sweep_argv(out, *extra):
    return ["--model", "tiny", "--bench", "humaneval", "gsm8k", "--limit", "2", "--max-new-token", "8",
            "--out-dir", str(out), "--exec-timeout", "5", "--no-warmup", *extra]


def test_sweep_writes_csv_json_png_and_resumes(tmp_path, use_model, capsys):
    out = tmp_path / "sweep"
    assert sweep.main(sweep_argv(out, "--thresholds", "0.5,2", "--fsd", "jsd/original:0.3")) == 0
    records = mtbench.read_answers(out / "records.jsonl")
    assert len(records) == 2 * 2 * 5  # benches x problems x (plain, lossless, kl_qp T=0.5, T=2, jsd original)
    import csv

    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    methods = ["plain", "lossless", "kl_qp T=0.5", "kl_qp T=2", "jsd original T=0.3"]
    assert [(r["bench"], r["method"]) for r in rows] == [(b, m) for b in ("humaneval", "gsm8k") for m in methods]
    assert all(r["problems"] == "2" and 0 <= float(r["accuracy"]) <= 1 for r in rows)
    assert all(float(r["speedup_vs_plain"]) == pytest.approx(1.0) for r in rows if r["method"] == "plain")
    assert all(float(r["speedup_vs_lossless"]) == pytest.approx(1.0) for r in rows if r["method"] == "lossless")
    assert {(r["divergence"], r["mode"]) for r in rows if r["method"].startswith("jsd")} == {("jsd", "original")}
    for bench in ("humaneval", "gsm8k"):
        assert (out / f"frontier_{bench}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "summary.json").read_text())["rows"][0]["method"] == "plain"
    with open(out / "problems.csv") as f:
        answers = list(csv.DictReader(f))
    assert len(answers) == len(records) and {a["correct"] for a in answers} <= {"True", "False"}

    with pytest.raises(SystemExit, match="--resume"):
        sweep.main(sweep_argv(out, "--thresholds", "0.5,2"))
    loads = len(use_model)
    assert sweep.main(sweep_argv(out, "--thresholds", "0.5,2,4", "--resume")) == 0  # only T=4's runs are new
    assert len(mtbench.read_answers(out / "records.jsonl")) == 2 * 2 * 6 and len(use_model) == loads + 1


def test_sweep_resumes_after_a_kill_without_losing_or_repeating(tmp_path, use_model, monkeypatch):
    """A run stopped after 5 answers, its last line torn by the kill, resumes with exactly the missing runs."""
    out = tmp_path / "killed"
    calls = []
    solve = sweep.solve

    def dying_solve(*args):
        if len(calls) == 5:
            raise KeyboardInterrupt  # what Ctrl-C raises; a SIGKILL leaves at most a torn line, added below
        calls.append(args[2:4])
        return solve(*args)

    monkeypatch.setattr(sweep, "solve", dying_solve)
    argv = sweep_argv(out, "--thresholds", "1", "--plain-limit", "1")
    sweep.main(argv)
    with open(out / "records.jsonl", "a") as f:
        f.write('{"bench": "gsm8k", "task_id": "gsm8k/0", "meth')
    monkeypatch.setattr(sweep, "solve", solve)
    calls.clear()
    monkeypatch.setattr(sweep, "solve", lambda *args: calls.append(args[2:4]) or solve(*args))
    assert sweep.main(argv + ["--summary-only"]) == 0 and not calls  # summarizes the 5 there, runs nothing
    assert len(mtbench.read_answers(out / "records.jsonl")) == 5 and (out / "summary.csv").is_file()
    assert sweep.main(argv + ["--resume"]) == 0
    records = mtbench.read_answers(out / "records.jsonl")
    keys = [(r["bench"], r["task_id"], r["method"]) for r in records]
    # 2 benches x 2 problems x (lossless, T=1) + plain on the first problem of each = 10, none twice
    assert len(keys) == len(set(keys)) == 10 and len(calls) == 5
    assert sum(r["method"] == "plain" for r in records) == 2


def test_sweep_arm_specs_and_errors():
    job = sweep.parse_args(["--model", "m", "--fsd-divergence", "tv", "--thresholds", "0.5",
                            "--fsd", "kl_pq:1,2", "--fsd", "kl_qp/original:3", "--fsd", "tv:0.5",
                            "--fsd-exact-prefix", "4"])
    assert [a.label for a in job.arms] == ["plain", "lossless", "tv T=0.5", "kl_pq T=1", "kl_pq T=2",
                                           "kl_qp original T=3"]
    assert job.arms[0].plain and job.arms[1].fsd is None
    assert (job.arms[5].fsd.divergence, job.arms[5].fsd.mode, job.arms[5].fsd.threshold) == ("kl_qp", "original", 3)
    assert all(a.fsd.exact_prefix == 4 for a in job.arms[2:])
    for spec, message in (("kl:1", "DIVERGENCE"), ("kl_qp/lossy:1", "RULE"), ("kl_qp", "DIVERGENCE"),
                          ("kl_qp:0.1;0.5", "comma-separated"), ("kl_qp:0.1,-1", ">= 0"),
                          ("kl_qp:1@16/x/2", "TOTAL_TOKEN/DEPTH/TOP_K"), ("kl_qp:1@16/5/0", "branching"),
                          ("lossless", "DIVERGENCE")):
        with pytest.raises(SystemExit, match=message):
            sweep.parse_arm_spec(spec)
    deep = sweep.parse_arm_spec("kl_qp/original:2,8@16/5/2")
    assert [a.label for a in deep] == ["kl_qp original T=2 @16/5/2", "kl_qp original T=8 @16/5/2"]
    assert all(a.shape == TreeShape(16, 5, 2) and a.tree == "16/5/2" for a in deep)
    (lossless,) = sweep.parse_arm_spec("lossless@8/3/2/4096")
    assert (lossless.label, lossless.fsd, lossless.shape) == ("lossless @8/3/2/4096", None, TreeShape(8, 3, 2, 4096))


def test_sweep_arm_on_its_own_tree(tmp_path, use_model):
    """An arm with its own tree decodes on it (lossless there: the same greedy replies, fewer tokens per step on a
    smaller tree), and its rows and records name the tree."""
    out = tmp_path / "trees"
    assert sweep.main(sweep_argv(out, "--fsd", "lossless@2/1/1", "--fsd", "kl_qp:1@2/1/1", "--plain-limit", "1")) == 0
    records = mtbench.read_answers(out / "records.jsonl")
    by = {(r["task_id"], r["method"]): r for r in records}
    for task_id in {r["task_id"] for r in records}:  # plain, lossless on each tree, FSD on the small one
        own, small = by[(task_id, "lossless")], by[(task_id, "lossless @2/1/1")]
        assert small["reply"] == own["reply"] and small["tree"] == "2/1/1" and own["tree"] is None
        assert small["accepted"] <= small["verify_steps"] and small["verify_steps"] >= own["verify_steps"]
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert {r["method"]: r["tree"] for r in rows if r["bench"] == "gsm8k"} == {
        "plain": None, "lossless": None, "lossless @2/1/1": "2/1/1", "kl_qp T=1 @2/1/1": "2/1/1"}
    assert all(r["tau"] <= 2 for r in rows if r["tree"] == "2/1/1")  # one draft token per step at most


def test_sweep_problem_selection():
    problems = [{"task_id": i} for i in range(10)]
    picked = sweep.select_problems(problems, sample=4, seed=3)
    assert picked == sweep.select_problems(problems, sample=4, seed=3)  # fixed by the seed
    assert len(picked) == 4 and [p["task_id"] for p in picked] == sorted(p["task_id"] for p in picked)
    assert picked != sweep.select_problems(problems, sample=4, seed=4)
    assert sweep.select_problems(problems, sample=20) == problems  # fewer problems than the sample: all
    assert sweep.select_problems(problems, limit=3) == problems[:3]
    todo = sweep.pending({"b": problems[:3]}, [sweep.Arm("plain", plain=True), sweep.Arm("lossless")],
                         {("b", "lossless", 1)}, plain_limit=2)
    assert [(p["task_id"], a.label) for _, p, a in todo] == [(0, "plain"), (0, "lossless"), (1, "plain"),
                                                               (2, "lossless")]


# ---------------------------------------------------------------- HumanEval execution (subprocess, never in-process)
@pytest.fixture(scope="module")
def problem0():
    return humaneval.load_problems(1)[0]


def test_humaneval_canonical_solution_passes(problem0):
    reply = f"```python\n{problem0['prompt']}{problem0['canonical_solution']}```"
    assert humaneval.score(problem0, reply, timeout=20).status == "passed"
    # the same body as a bare continuation of the prompt also counts
    assert humaneval.score(problem0, problem0["canonical_solution"], timeout=20).passed


def test_humaneval_wrong_solution_fails(problem0):
    reply = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    result = humaneval.score(problem0, reply, timeout=20)
    assert result.status == "failed" and "AssertionError" in result.detail


def test_hanging_program_times_out_and_is_killed():
    result = humaneval.run_program("import time\nwhile True:\n    time.sleep(0.05)\n", timeout=1.0)
    assert result.status == "timeout" and not result.passed


def test_evaluated_code_has_no_network():
    source = "import socket\nsocket.create_connection(('127.0.0.1', 9))\n"
    result = humaneval.run_program(source, timeout=20)
    assert result.status == "failed" and "network access is disabled" in result.detail


def test_code_extraction():
    assert humaneval.extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1\n"
    assert humaneval.extract_code("```\nx = 1\n") == "x = 1\n"  # cut off by the token budget
    assert humaneval.extract_code("    return 1\n") == "    return 1\n"


# ---------------------------------------------------------------- GSM8K matching
def test_gsm8k_answers():
    first = gsm8k.load_problems(2)[0]
    assert first["target"] == "18" and first["task_id"] == "gsm8k/0"
    assert gsm8k.judge(first, "16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18")[0]
    assert gsm8k.judge(first, "She makes $18.00 every day.")[0]  # no '####': the last number
    assert not gsm8k.judge(first, "#### 19\nor maybe 18")[0]
    assert gsm8k.extract_answer("#### $1,234.50") == "1234.5"
    assert gsm8k.extract_answer("no numbers here") is None
    assert gsm8k.extract_answer("It is -3.") == "-3"


def test_gpqa_problems_and_answers():
    from eagle_fsd.eval import gpqa

    problems = gpqa.load_problems()
    assert len(problems) == 198 and problems == gpqa.load_problems()  # the shuffle is fixed per question
    first = problems[0]
    assert sorted(first["choices"]) == sorted(["10^-4 eV", "10^-11 eV", "10^-8 eV", "10^-9 eV"])
    assert first["choices"]["ABCD".index(first["target"])] == "10^-4 eV"  # the file's correct answer
    assert {p["target"] for p in problems} == set("ABCD")  # not always the first choice
    message = gpqa.user_message(first)
    assert "Answer: $LETTER" in message and f"{first['target']}) 10^-4 eV" in message
    assert gpqa.judge(first, f"Step by step...\nAnswer: {first['target']}") == (True, f"answer {first['target']}, "
                                                                                   f"target {first['target']}")
    assert gpqa.extract_answer("**Answer: c**") == "C" and gpqa.extract_answer("Answer: D\nAnswer: A") == "A"
    assert gpqa.extract_answer("I cannot tell.") is None


def test_bench_shared_prefix_counts_new_tokens_before_the_first_difference():
    from eagle_fsd.eval.bench import shared_prefix

    ref = torch.tensor([[7, 7, 1, 2, 3, 4]])  # a 2-token prompt, then 1 2 3 4
    assert shared_prefix(ref, ref, 2) == 4
    assert shared_prefix(torch.tensor([[7, 7, 1, 2, 9, 4]]), ref, 2) == 2
    assert shared_prefix(torch.tensor([[7, 7, 5, 2, 3, 4]]), ref, 2) == 0
    assert shared_prefix(torch.tensor([[7, 7, 1, 2]]), ref, 2) == 2  # one stopped early: the shorter length


def test_bench_vllm_rows_count_prefill_and_steps_and_compare_with_hf(tmp_path):
    """vLLM's rows as bench reads them from its worker: tau = new tokens / (verification steps + the prefill),
    none for plain vLLM; identity with HF generate's output per question; FSD rows are not compared."""
    from collections import defaultdict

    from eagle_fsd.eval.bench import add_vllm_rows, summarize_rows
    from eagle_fsd.eval.vllm_peer import VllmJob, row_names, run_rows

    ids_list = [torch.tensor([[5, 6]]), torch.tensor([[8]])]
    reference = [torch.tensor([[5, 6, 1, 2, 3, 4]]), torch.tensor([[8, 9, 9]])]
    rows = {"vllm": [{"tokens": [1, 2, 3, 4], "wall_time": 2.0, "steps": 0, "accepted": 0},
                     {"tokens": [9, 7], "wall_time": 1.0, "steps": 0, "accepted": 0}],
            "vllm draft_model": [{"tokens": [1, 2, 3, 4], "wall_time": 1.0, "steps": 1, "accepted": 2},
                                 {"tokens": [9, 7], "wall_time": 1.0, "steps": 0, "accepted": 0}],
            "vllm fsd kl_qp T=4": [{"tokens": [1, 2, 3, 5], "wall_time": 1.0, "steps": 1, "accepted": 3},
                                   {"tokens": [9, 9], "wall_time": 0.5, "steps": 0, "accepted": 0}]}
    totals = {"hf-generate": defaultdict(float, tokens=6, seconds=3.0)}
    per_question = {"hf-generate": [2.0, 2.0]}
    add_vllm_rows(rows, ids_list, reference, totals, per_question)
    by_name = {r["method"]: r for r in summarize_rows(totals, per_question, len(ids_list))}
    assert "tau" not in by_name["vllm"] and by_name["vllm"]["identical_to_hf_generate"] == "1/2"
    assert by_name["vllm draft_model"]["tau"] == 2.0  # 6 tokens over 3 forwards: 2 prefills, 1 step
    assert by_name["vllm draft_model"]["identical_to_hf_generate"] == "1/2"
    assert by_name["vllm draft_model"]["shared_prefix_with_hf_generate"] == 2.5  # 4, then 1
    assert by_name["vllm draft_model"]["identical_to_vllm_plain"] == "2/2"
    assert by_name["vllm fsd kl_qp T=4"]["speedup"] == 2.0 and "identical_to_hf_generate" not in \
        by_name["vllm fsd kl_qp T=4"]
    job = VllmJob("t", "d", "auto", [[1]], 8, 2, fsd=[("kl_qp", 4.0)])
    assert row_names(job) == list(rows)
    with pytest.raises(FileNotFoundError, match="--also-vllm .*venv-vllm/bin/python"):
        run_rows(str(tmp_path / "python"), job)


def test_every_speculative_arm_is_warmed_before_its_first_timed_answer(tiny_chat_model):
    """A rule's first call pays its lazy set-up (the divergence pass, its tree): warm_up_arms calls each speculative
    arm once, untimed, so each rule's tree is made before the timed answers; the plain arm needs none."""
    from eagle_fsd.eval.arms import LOSSLESS, PLAIN, Arm, fsd_arm
    from eagle_fsd.eval.mtbench import warm_up_arms
    from eagle_fsd.plan import rule_key
    from eagle_fsd.prompts import PromptFormat
    from eagle_fsd.settings import GenerationSettings

    model = tiny_chat_model
    fuzzy = fsd_arm("kl_qp", "reducible", 2.5)
    model._trees.clear()
    warm_up_arms(model, GenerationSettings(), [Arm(PLAIN, plain=True), Arm(LOSSLESS), fuzzy],
                 PromptFormat(model.tokenizer))
    assert set(model._trees) == {None, rule_key(fuzzy.fsd)}


def test_bench_warms_every_rule_before_the_timed_runs(tiny_chat_model):
    """bench times each question by every method in turn: every rule (not only the first) is called once, untimed,
    so that no rule's first timed answer pays its set-up."""
    from eagle_fsd.eval.bench import warm_up_rules
    from eagle_fsd.fsd import FsdConfig
    from eagle_fsd.plan import rule_key

    model = tiny_chat_model
    rules = [FsdConfig(threshold=2.5), FsdConfig(threshold=8.0)]
    model._trees.clear()
    warm_up_rules(model, rules, torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(0)))
    assert set(model._trees) == {None, *map(rule_key, rules)}
