"""Scoring benchmark workloads: answers read strictly, HumanEval run with its tests in the sandbox."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from paths import DATA

from kvbench.analysis.task_score import score_requests, task_figures
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.tasks.gsm8k import gsm8k_answer, same_number
from kvbench.tracegen.tasks.humaneval import humaneval_completion
from kvbench.tracegen.tasks.mmlu import mmlu_answer
from kvbench.tracegen.tokenizer import load_tokenizer


@pytest.mark.parametrize("output, answer, how", [
    ("6 * 12 = 72, 72 - 50 = 22.\nThe answer is 22.", "22", "marker"),
    ("The answer is: $1,250.00 in all.", "1250.00", "marker"),
    ("The answer is 7. Wait, the answer is 9.", "9", "marker"),  # the last marker counts
    ("So she has 15 apples, then 20 more: 35", "35", "last number"),
    ("no figures at all", None, "none"),
])
def test_gsm8k_reads_the_marker_then_the_last_number(output: str, answer: str | None, how: str) -> None:
    parsed = gsm8k_answer(output)
    assert (parsed.answer, parsed.how) == (answer, how)


def test_gsm8k_answers_compare_as_numbers() -> None:
    assert same_number("1250.00", "1,250") and same_number("-3", "-3.0")
    assert not same_number("125", "1250") and not same_number(None, "3")


@pytest.mark.parametrize("output, letter", [
    ("Mercury is closest to the Sun.\nAnswer: B", "B"),
    ("Reasoning...\n**Answer: (C)**", "C"),
    ("Answer: A.\n", "A"),
    ("Answer: A\nOn second thought:\nAnswer: D", "D"),
    ("The answer is B because Mercury is fast.", None),  # no answer line: never guessed
    ("Answer: B or C", None),
    ("Answer: E", None),
    ("I think A and B are wrong. C might be. Answer follows: D", None),
])
def test_mmlu_takes_only_a_strict_answer_line(output: str, letter: str | None) -> None:
    assert mmlu_answer(output).answer == letter


def test_humaneval_takes_the_last_code_block_and_keeps_a_body_as_a_continuation() -> None:
    whole = "Plan first.\n```python\ndef f(x):\n    return 1\n```\nThen:\n```python\ndef f(x):\n    return x\n```\n"
    assert humaneval_completion(whole, "f").answer == "\ndef f(x):\n    return x\n"
    body = "    return x + 1\n"
    assert humaneval_completion(body, "f").answer == body and humaneval_completion(body, "f").how == "raw"


def _requests(trajectories, texts: list[str], tokenizer) -> pd.DataFrame:
    rows = []
    for trajectory, text in zip(trajectories, texts):
        for turn in trajectory.turns:
            final = turn.turn_id == trajectory.task.final_turn
            rows.append({"trajectory_id": trajectory.trajectory_id, "turn_id": turn.turn_id,
                         "success": final and text is not None,
                         "output_token_ids": tokenizer.encode(text if final and text is not None else "notes")})
    return pd.DataFrame(rows)


def _gsm8k_outputs(golds: list[str]) -> list[str | None]:
    return [f"Left: 72 - 50.\nThe answer is {golds[0]}.", f"The answer is {int(golds[1]) + 1}.",
            f"so {int(golds[2]):,} in all", None]  # right, wrong, right by the last number, failed


def _mmlu_outputs(golds: list[str]) -> list[str | None]:
    other = "A" if golds[1] != "A" else "B"
    return [f"Answer: {golds[0]}", f"Answer: {other}", f"It is {golds[2]}, clearly.", None]


@pytest.mark.parametrize("task, data, outputs, correct, unparseable", [
    ("gsm8k", "gsm8k-sample.jsonl", _gsm8k_outputs, [True, False, True, False], 0),
    ("mmlu", "mmlu-sample.parquet", _mmlu_outputs, [True, False, False, False], 1),  # the third has no answer line
])
def test_a_run_scores_its_final_answers(task: str, data: str, outputs, correct: list[bool], unparseable: int) -> None:
    tokenizer = load_tokenizer(None)
    trajectories = generate_trace(TraceSpec(task=task, data=str(DATA / data), shared_tokens=0, qps=0, limit=4),
                                  tokenizer)[1]
    texts = outputs([t.task.answers[0].answer for t in trajectories])  # type: ignore[union-attr]
    scores = score_requests(_requests(trajectories, texts, tokenizer), trajectories, tokenizer.decode)
    assert scores["correct"].tolist() == correct and scores["final"].all()
    assert scores["item_id"].notna().all()
    figures = task_figures(scores)
    assert figures["task_accuracy"] == sum(correct) / len(correct)
    assert figures["task_unparseable"] == unparseable


def test_humaneval_runs_score_pass_at_1_from_their_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbench.tracegen.tasks.sandbox.code_execution import CONSENT_ENV

    monkeypatch.setenv(CONSENT_ENV, "1")  # the checks run in the sandbox (tests/unit/tracegen/test_code_sandbox.py)
    tokenizer = load_tokenizer(None)
    trajectories = generate_trace(TraceSpec(task="humaneval", data=str(DATA / "humaneval-sample.jsonl"),
                                            shared_tokens=0, qps=0), tokenizer)[1]
    passing = ("```python\ndef count_vowels(text: str) -> int:\n"
               "    return sum(1 for c in text.lower() if c in 'aeiou')\n```")
    failing = "```python\ndef running_max(values):\n    return values\n```"
    scores = score_requests(_requests(trajectories, [passing, failing], tokenizer), trajectories, tokenizer.decode)
    assert scores["correct"].tolist() == [True, False]
    assert scores["detail"].iloc[0] == "passed" and scores["detail"].iloc[1].startswith("failed")
    assert task_figures(scores)["task_accuracy"] == 0.5


GOLDEN_TABLE1 = DATA / "golden-table1"  # stub replays with hand-written final answers: tests/data/README.md


def test_paper_table1_renders_accuracy_with_its_interval_beside_the_papers(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvbench.cli import main

    result = CliRunner().invoke(main, ["paper", "table1", "--results", str(GOLDEN_TABLE1), "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "table1.md").read_text()
    ours = text.split("### final-answer accuracy (%; HumanEval: pass@1) [95% interval]")[1].split("### the paper")[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in ours.splitlines() if line.startswith("| ") and "method" not in line}
    # columns in the paper's order (mmlu, gsm8k); Wilson intervals over 4 items each
    assert rows == {"fullshared": ["50.0 [15, 85]", "50.0 [15, 85]"], "nonshared": ["75.0 [30, 95]", "100.0 [51, 100]"]}
    assert list(rows) == ["nonshared", "fullshared"]  # the paper's row order
    assert "| NonShared    | 67.54  | 85.60   | 86.96       |" in text  # the paper's values, as printed
    assert "kvbench:recall-v1 is a constructed test model" in text
    unreadable = text.split("### final answers that could not be read")[1]
    assert "| fullshared |      1 |       0 |" in unreadable
    frame = pd.read_csv(tmp_path / "table1.csv")
    assert set(frame["task"]) == {"gsm8k", "mmlu"} and frame["task_items"].eq(4).all()


def _frame(rows: list[dict]) -> pd.DataFrame:
    """Rows as `average_repeats` gives them, for the accuracy tables' renderers."""
    import json

    base = {"model": "meta-llama/Llama-3.1-8B-Instruct", "qps": 1.0, "task_items": 100.0, "task_unparseable": 0.0,
            "realized_rho": 0.8, "repeats": 1, "task_accuracy_ci": float("nan"), "task_accuracy_std": float("nan")}
    return pd.DataFrame([{**base, **row, "method_params": json.dumps(row.get("params", {}), sort_keys=True),
                          "method_config": row.get("config", row["method"])} for row in rows])


def test_table5_shows_the_spread_over_repeats_beside_the_papers(tmp_path: Path) -> None:
    from kvbench.analysis.paper.accuracy import render_table5

    frame = _frame([{"method": "kvcmas", "task": "mmlu", "task_accuracy": 0.65, "repeats": 3,
                     "task_accuracy_std": 0.0123, "task_accuracy_ci": 0.03}])
    text = render_table5(frame, tmp_path, True)
    ours, paper = text.split("### this machine")[1].split("### the paper: Table 5")
    assert "over 3 runs" in text and "| kvcmas   |   1.23 |" in ours and "| KVCMAS       | 0.36   | 0.35    |" in paper
    assert "constructed test model" not in text  # a real model's name


def test_table6_rows_are_taus_with_accuracy_rho_and_the_papers_values(tmp_path: Path) -> None:
    from kvbench.analysis.paper.accuracy import render_table6

    frame = _frame([{"method": "kvcmas", "config": f"kvcmas-tau{t}", "params": {"tau": t}, "task": "mmlu",
                     "task_accuracy": a, "realized_rho": r} for t, a, r in ((0.3, 0.6, 0.82), (0.1, 0.7, 0.6))])
    lines = [line for line in render_table6(frame, tmp_path, True).splitlines() if line.startswith("| mmlu")]
    assert [line.split("|")[2].strip() for line in lines] == ["0.1", "0.3"]  # sorted by tau
    assert "70.0 [60, 78]" in lines[0] and "67.47" in lines[0] and "0.623" in lines[0]
    assert "64.66" in lines[1] and "0.820" in lines[1]


def test_table8_and_table13_accuracy(tmp_path: Path) -> None:
    from kvbench.analysis.paper.accuracy import render_table8
    from kvbench.analysis.paper.tables import render_table13

    frame = _frame([{"method": m, "task": "mmlu", "task_accuracy": a} for m, a in
                    (("kvcmas", 0.6), ("kvcmas-nonchained", 0.5), ("nonshared", 0.7))])
    text = render_table8(frame, tmp_path, True)
    assert "nonshared" not in text and "| kvcmas-nonchained | 50.0 [40, 60] |" in text and "59.01" in text
    efficiency = {"p50_ttft_s": 1.0, "mean_ttft_s": 1.0, "throughput_tok_s": 100.0, "method_state_mib": 5.0}
    v_frame = _frame([{"method": "kvcmas", "config": f"kvcmas-V{v}", "params": {"V": v}, "task": task, "qps": 0.0,
                       "task_accuracy": 0.6 if task == "mmlu" else float("nan"),
                       **{k: x for k, x in efficiency.items()}, **{f"{k}_ci": float("nan") for k in efficiency}}
                      for v in (1, 10) for task in ("none", "mmlu")])
    ours, paper = render_table13(v_frame, tmp_path, True).split("### the paper: Table 13")
    row = next(line for line in ours.splitlines() if line.startswith("| kvcmas-V10"))
    assert "60.0 [50, 69]" in row and "65.45" in next(line for line in paper.splitlines() if line.startswith("| 10 "))
