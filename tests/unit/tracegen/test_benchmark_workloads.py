"""The paper's agent workloads on benchmark items (gen-trace --task mmlu|gsm8k|humaneval)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner
from paths import DATA

from kvbench.cli import main
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.schema import OUT_PREFIX, Trajectory
from kvbench.tracegen.tasks.benchmark import chat_frame
from kvbench.tracegen.tasks.registry import get_task
from kvbench.tracegen.tokenizer import TraceTokenizer, load_tokenizer
from kvbench.tracegen.trace_files import read_trace

ROLES = {"mmlu": ["Knowledgeable Expert", "Wiki Searcher", "Critic", "FinalRefer"],
         "gsm8k": ["Math Solver", "Mathematical Analyst", "Programming Expert", "FinalRefer"],
         "humaneval": ["Project Manager", "Algorithm Designer", "Programming Expert", "FinalRefer"]}
FIXTURES = {"mmlu": DATA / "mmlu-sample.parquet", "gsm8k": DATA / "gsm8k-sample.jsonl",
            "humaneval": DATA / "humaneval-sample.jsonl"}


def _trace(task: str, tokenizer: TraceTokenizer | None = None, **spec: object) -> list[Trajectory]:
    tokenizer = tokenizer or load_tokenizer(None)
    params = {"task": task, "data": str(FIXTURES[task]), "num_agents": 4, "shared_tokens": 0, "qps": 0.0, **spec}
    return generate_trace(TraceSpec(**params), tokenizer)[1]  # type: ignore[arg-type]


@pytest.mark.parametrize("task", ["mmlu", "gsm8k", "humaneval"])
def test_each_item_is_one_trajectory_of_three_task_agents_and_finalrefer(task: str) -> None:
    trajectories = _trace(task)
    assert len(trajectories) == {"mmlu": 8, "gsm8k": 8, "humaneval": 2}[task]
    first = trajectories[0]
    assert [first.agents[a].role for a in ("A0", "A1", "A2", "A3")] == ROLES[task]
    assert [t.after for t in first.turns] == [[], ["A0.r0"], ["A1.r0"], ["A2.r0"]]
    for position, turn in enumerate(first.turns):
        keys = [s.ph for s in turn.segments if s.ph is not None]
        # the question first, then every earlier agent's output, in order
        assert keys == ["q"] + [f"{OUT_PREFIX}A{j}.r0" for j in range(position)]
        assert turn.stop_at_eos
    assert first.task is not None and first.task.name == task and first.task.final_turn == "A3.r0"
    assert [a.turn_id for a in first.task.answers] == ["A3.r0"]
    gold = {"mmlu": "B", "gsm8k": "22", "humaneval": "KVBench/0"}[task]
    assert first.task.answers[0].answer == gold
    question = first.shared["q"].text
    if task == "mmlu":
        assert question.startswith("Which planet") and question.endswith("D. Earth")
    elif task == "gsm8k":
        assert question.startswith("A baker fills 6 trays") and first.task.item_id == "gsm8k-0"
    else:
        assert question.startswith("def count_vowels") and first.task.entry_point == "count_vowels"
        assert first.task.test is not None and "def check(candidate)" in first.task.test
        assert first.task.item_id == "KVBench/0"


def test_the_final_agent_is_told_the_answer_format_scoring_reads() -> None:
    assert "'The answer is N.'" in get_task("gsm8k").agent_roles[-1].system
    assert "'Answer: X'" in get_task("mmlu").agent_roles[-1].system
    assert "```python" in get_task("humaneval").agent_roles[-1].system


def test_limit_samples_items_with_the_seed_and_the_trace_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "gsm8k.jsonl"
    result = CliRunner().invoke(main, ["gen-trace", "-o", str(out), "--task", "gsm8k", "--data",
                                       str(FIXTURES["gsm8k"]), "--limit", "3", "--seed", "5", "--qps", "0"])
    assert result.exit_code == 0, result.output
    trace = read_trace(out)
    again = _trace("gsm8k", limit=3, seed=5)
    assert [t.task.item_id for t in trace.trajectories] == [t.task.item_id for t in again]  # type: ignore[union-attr]
    assert len(trace.trajectories) == 3 and trace.header.generator["limit"] == 3


@pytest.mark.parametrize("args, message", [
    (["--task", "mmlu"], "--task mmlu needs --data PATH"),
    (["--task", "gsm8k", "--data", str(FIXTURES["gsm8k"]), "--agents", "3"], "num_agents=3 does not apply"),
    (["--task", "gsm8k", "--data", str(FIXTURES["gsm8k"]), "--shared-tokens", "512"], "shared_tokens=512"),
    (["--task", "mmlu", "--data", str(FIXTURES["gsm8k"])], "row 1: choices: missing"),
    (["--task", "recall", "--limit", "3"], "--data and --limit are for tasks that read items (--task gsm8k, humaneval, mmlu)"),
    (["--task", "gsm8k", "--data", str(FIXTURES["gsm8k"]), "--roles", "code"], "--roles does not apply"),
    (["--task", "gsm8k", "--data", str(FIXTURES["gsm8k"]), "--num-trajectories", "3"], "--limit picks items"),
])
def test_bad_benchmark_requests_are_clear_errors(args: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["gen-trace", "-o", str(tmp_path / "t.jsonl"), *args])
    assert result.exit_code != 0 and message in result.output, result.output


_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
              "[INST] {{ m['content'] }} [/INST]{% endfor %}")


def _templated(template: str) -> tuple[TraceTokenizer, object]:
    from transformers import AutoTokenizer

    from kvbench.model.resolve import resolve_model

    hf = AutoTokenizer.from_pretrained(resolve_model(None))
    hf.chat_template = template
    hf.bos_token = "<bos-text>"
    plain = load_tokenizer(None)
    return dataclasses.replace(plain, prompt_prefix_ids=[0], chat_tokenizer=hf), hf


@pytest.mark.parametrize("template", [_TEMPLATE, _NO_SYSTEM])
def test_a_chat_template_frames_every_prompt_and_the_question_stays_one_shared_segment(template: str) -> None:
    tokenizer, hf = _templated(template)
    frame = chat_frame(tokenizer)
    assert frame is not None and not frame.before.startswith("<bos-text>")  # the header's prefix carries BOS
    trajectory = _trace("gsm8k", tokenizer, limit=1)[0]
    outputs = {f"A{j}.r0": f"note {j}" for j in range(3)}
    for turn in trajectory.turns:
        agent = trajectory.agents[turn.agent]
        pieces = []
        for segment in turn.segments:
            if segment.pf == "system":
                pieces.append(agent.system)
            elif segment.pf == "text":
                pieces.append(segment.text)
            elif segment.ph == "q":
                pieces.append(trajectory.shared["q"].text)
            else:
                pieces.append(outputs[segment.ph.removeprefix(OUT_PREFIX)])  # type: ignore[union-attr]
        text = "".join(pieces)  # type: ignore[arg-type]
        # what the model's template makes of the role (system) and the rest (user), BOS aside
        user = text[text.index(agent.system) + len(agent.system):]
        assert text.startswith(frame.before) and text.endswith(frame.after)
        user = user[len(frame.between):len(user) - len(frame.after)]
        messages = [{"role": "system", "content": agent.system}, {"role": "user", "content": user}]
        if template == _NO_SYSTEM:
            messages = [{"role": "user", "content": agent.system + "\n\n" + user}]
        rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
        assert rendered.removeprefix("<bos-text>") == text


def test_models_without_a_chat_template_get_plain_text() -> None:
    assert chat_frame(load_tokenizer(None)) is None
    first = _trace("mmlu", limit=1)[0].turns[0]
    assert first.segments[0].pf == "system" and first.segments[-1].text == "\n\nYour turn.\n\n"


def test_benchmark_turns_are_sent_to_stop_at_eos_and_controlled_ones_not(tmp_path: Path) -> None:
    from kvbench.replay.stub import StubServer

    bodies = {}
    for task, extra in (("gsm8k", ["--data", str(FIXTURES["gsm8k"]), "--limit", "1"]),
                        ("none", ["--shared-tokens", "64", "--num-trajectories", "1"])):
        trace = tmp_path / f"{task}.jsonl"
        assert CliRunner().invoke(main, ["gen-trace", "-o", str(trace), "--task", task, "--output-len", "4",
                                         "--qps", "0", *extra]).exit_code == 0
        with StubServer() as stub:
            result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--base-url", stub.base_url,
                                               "--qps", "0", "--num-warmups", "0",
                                               "--result-dir", str(tmp_path / f"run-{task}")])
            assert result.exit_code == 0, result.output
            bodies[task] = list(stub.bodies.values())
    assert len(bodies["gsm8k"]) == 4 and not any(b["ignore_eos"] for b in bodies["gsm8k"])
    assert bodies["none"] and all(b["ignore_eos"] for b in bodies["none"])


def test_an_agent_stopped_by_eos_passes_on_its_text_without_the_eos_token(tmp_path: Path) -> None:
    import pandas as pd

    from kvbench.replay.stub import StubServer

    trace = tmp_path / "gsm8k.jsonl"
    assert CliRunner().invoke(main, ["gen-trace", "-o", str(trace), "--task", "gsm8k", "--data",
                                     str(FIXTURES["gsm8k"]), "--limit", "1", "--output-len", "8",
                                     "--qps", "0"]).exit_code == 0
    with StubServer(eos_after=3) as stub:
        result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--base-url", stub.base_url, "--qps", "0",
                                           "--num-warmups", "0", "--save-prompt-ids",
                                           "--result-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(tmp_path / "run" / "requests.parquet").set_index("turn_id")
    first = list(requests.loc["A0.r0", "output_token_ids"])
    assert len(first) == 4 and first[-1] == 2  # what the server generated, EOS included
    later = list(requests.loc["A1.r0", "prompt_token_ids"])
    text = first[:-1]
    assert any(later[i:i + 3] == text for i in range(len(later))) and 2 not in later  # its text, no EOS


def test_under_ignore_eos_an_agent_passes_on_only_its_message(tmp_path: Path) -> None:
    """The paper's fixed output lengths: the model runs on past its end of sequence, and the next
    agent reads the message up to it, not the control token or what followed it."""
    import pandas as pd

    from kvbench.replay.stub import StubServer

    trace = tmp_path / "fixed.jsonl"
    assert CliRunner().invoke(main, ["gen-trace", "-o", str(trace), "--shared-tokens", "64", "--output-len", "8",
                                     "--num-trajectories", "1", "--qps", "0"]).exit_code == 0
    with StubServer(eos_after=3) as stub:
        result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--base-url", stub.base_url, "--qps", "0",
                                           "--num-warmups", "0", "--save-prompt-ids",
                                           "--result-dir", str(tmp_path / "run")])
        assert all(b["ignore_eos"] for b in stub.bodies.values())
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(tmp_path / "run" / "requests.parquet").set_index("turn_id")
    first = list(requests.loc["A0.r0", "output_token_ids"])
    assert len(first) == 8 and first[3] == 2  # generated whole: the end of sequence, then more
    later = list(requests.loc["A1.r0", "prompt_token_ids"])
    assert any(later[i:i + 3] == first[:3] for i in range(len(later)))
    assert 2 not in later and not any(later[i:i + 2] == first[4:6] for i in range(len(later)))
    assert requests.loc["A1.r0", "prompt_tokens"] == len(later)


def test_a_benchmark_sweep_has_one_trace_per_task_and_one_cell_per_method_and_task(tmp_path: Path) -> None:
    from kvbench.experiment.sweep import MethodConfig, SweepSpec

    spec = SweepSpec(methods=[MethodConfig("nonshared"), MethodConfig("kvcmas", {"tau": 0.29})], qps=[1.0],
                     benchmarks={"gsm8k": str(FIXTURES["gsm8k"]), "humaneval": None}, num_trajectories=5,
                     num_warmups=1, output_len=64)
    traces = spec.trace_specs()
    assert set(traces) == {"gsm8k-a4-r1", "humaneval-a4-r1"}
    assert traces["gsm8k-a4-r1"].limit == 6 and traces["humaneval-a4-r1"].data is None  # the package's problems
    assert all(t.is_benchmark and t.shared_tokens == 0 for t in traces.values())
    cells = spec.cells(tmp_path)
    assert [(c.method.name, c.trace_id, c.num_trajectories) for c in cells] == [
        ("nonshared", "gsm8k-a4-r1", 5), ("nonshared", "humaneval-a4-r1", 5),
        ("kvcmas-tau0.29", "gsm8k-a4-r1", 5), ("kvcmas-tau0.29", "humaneval-a4-r1", 5)]
    # a stored sweep's JSON (benchmarks included) reads back as the same grid: it resumes
    assert SweepSpec.from_json(spec.to_json()) == spec
    for trace in traces.values():
        trace.validate()
