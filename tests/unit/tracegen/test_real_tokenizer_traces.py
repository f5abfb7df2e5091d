"""Traces for a real chat model (SmolLM2-135M-Instruct's tokenizer, fetched by scripts/install.sh):
prompts in its chat template, turns that end at its end of sequence, no control token passed on,
the recall tasks and role-lookup on its tokenizer, and the context check at generation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.model.resolve import resolve_model
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.roles import roles_for
from kvbench.tracegen.tasks.registry import get_task
from kvbench.tracegen.tasks.role_lookup import FACTS
from kvbench.tracegen.tasks.role_recall import parse_table
from kvbench.tracegen.tokenizer import load_tokenizer

SMOLLM2 = "kvbench:smollm2-135m"


@pytest.fixture(scope="module")
def smollm2():
    try:
        resolve_model(SMOLLM2, build_if_missing=False)
    except FileNotFoundError as exc:  # scripts/install.sh fetches it; a checkout set up otherwise must too
        pytest.fail(f"{exc} (scripts/install.sh does this)")
    return load_tokenizer(SMOLLM2)


def _prompt_text(tokenizer, trajectory, turn, outputs: dict[str, str]) -> str:
    parts = []
    for segment in turn.segments:
        if segment.pf == "system":
            parts.append(trajectory.agents[turn.agent].system)
        elif segment.pf == "text":
            parts.append(segment.text)
        elif segment.ph.startswith("out:"):
            parts.append(outputs[segment.ph[4:]])
        else:
            parts.append(trajectory.shared[segment.ph].text)
    return "".join(parts)


def test_controlled_prompts_are_the_models_chat_template_around_the_role(smollm2) -> None:
    spec = TraceSpec(task="role-lookup", roles="role-lookup", shared_tokens=300, output_len=16, num_trajectories=1,
                     chat_template=True, stop_at_eos=True)
    header, (trajectory,) = generate_trace(spec, smollm2)
    assert header.generator["chat_template"] is True and header.generator["stop_at_eos"] is True
    outputs = {t.turn_id: f"note of {t.turn_id}" for t in trajectory.turns}
    for turn in trajectory.turns:
        assert turn.stop_at_eos is True
        text = _prompt_text(smollm2, trajectory, turn, outputs)
        system = trajectory.agents[turn.agent].system
        user = text.split("<|im_start|>user\n", 1)[1].removesuffix("<|im_end|>\n<|im_start|>assistant\n")
        rendered = smollm2.chat.apply_chat_template([{"role": "system", "content": system},
                                                     {"role": "user", "content": user}],
                                                    tokenize=False, add_generation_prompt=True)
        assert text == rendered  # byte for byte what the model's template makes of these two messages
        # the shared segment stays token-identical across agents: the template's glue is agent text
        assert trajectory.shared["q"].text in user
    # the control tokens are single special ids in the prompt, not their characters as text
    ids = smollm2.encode(_prompt_text(smollm2, trajectory, trajectory.turns[0], outputs))
    assert ids[0] in smollm2.special_ids and smollm2.decode(ids[:1]) == "<|im_start|>"


def test_plain_and_fixed_length_forms_stay_available(smollm2) -> None:
    spec = TraceSpec(shared_tokens=200, output_len=8, num_trajectories=1, chat_template=False, stop_at_eos=False)
    header, (trajectory,) = generate_trace(spec, smollm2)
    assert all(t.stop_at_eos is None for t in trajectory.turns)  # exactly output_len tokens each
    assert not any("<|im_start|>" in (s.text or "") for t in trajectory.turns for s in t.segments)
    assert header.generator["chat_template"] is False and header.generator["stop_at_eos"] is False


def test_the_prompt_form_follows_the_model_unless_asked(smollm2) -> None:
    """Left open, a chat model's trace is a chat whose turns end at its end of sequence (in gen-trace,
    sweeps and replay's in-memory trace alike), the embedded models' plain text of fixed lengths."""
    spec = TraceSpec(shared_tokens=200, output_len=8, num_trajectories=1)
    chat = spec.with_prompt_form(smollm2)
    assert (chat.chat_template, chat.stop_at_eos) == (True, True)
    assert TraceSpec(stop_at_eos=False).with_prompt_form(smollm2).stop_at_eos is False  # chat, fixed lengths
    plain = spec.with_prompt_form(load_tokenizer(None))
    assert (plain.chat_template, plain.stop_at_eos) == (False, False)
    with pytest.raises(ValueError, match="has no chat template"):
        TraceSpec(chat_template=True).with_prompt_form(load_tokenizer(None))


def test_only_an_agents_message_is_passed_on(smollm2) -> None:
    end, start = smollm2.encode("<|im_end|>")[0], smollm2.encode("<|im_start|>")[0]
    words = smollm2.encode(" Paris is the home city.")
    assert smollm2.message_ids(words) == words
    assert smollm2.message_ids([*words, end]) == words  # stopped at its end of sequence
    assert smollm2.message_ids([*words, end, start, *words]) == words  # ignore_eos: what follows is not the message
    assert smollm2.message_ids([end, *words]) == []
    assert {end, start} <= smollm2.special_ids and words[0] not in smollm2.special_ids


@pytest.mark.parametrize("workflow", ["sequential", "fan-in"])
def test_role_recall_on_a_real_tokenizer_keeps_its_fixed_layout(smollm2, workflow: str) -> None:
    spec = TraceSpec(task="role-recall", roles="role-recall", workflow=workflow, shared_tokens=2048, output_len=8,
                     num_trajectories=3, seed=5)
    _, trajectories = generate_trace(spec, smollm2)
    for trajectory in trajectories:
        text = trajectory.shared["q"].text
        assert len(smollm2.encode(text)) == 2048
        routes = parse_table(text)
        assert len(routes) > 20 and all(len(set(t)) == 2 for t in routes.values())
        records = [line for line in text.split("\n") if " -> " in line or " >> " in line]
        assert len({len(smollm2.encode("\n" + line)) for line in records}) == 1  # every line one length
        assert {a.answer for a in trajectory.task.answers} <= set(routes)


def test_recall_on_a_real_tokenizer(smollm2) -> None:
    spec = TraceSpec(task="recall", roles="recall", shared_tokens=1024, output_len=8, num_trajectories=2, seed=2)
    _, trajectories = generate_trace(spec, smollm2)
    for trajectory in trajectories:
        assert len(smollm2.encode(trajectory.shared["q"].text)) == 1024
        answers = [a.answer for a in trajectory.task.answers]
        assert all(f"{answer}" in trajectory.shared["q"].text for answer in answers)


def test_role_lookup_answers_differ_by_role_and_lie_in_the_context(smollm2) -> None:
    spec = TraceSpec(task="role-lookup", roles="role-lookup", shared_tokens=2048, output_len=32, num_trajectories=4,
                     seed=9, chat_template=True, stop_at_eos=True, num_agents=4)
    _, trajectories = generate_trace(spec, smollm2)
    facts = [r.reports for r in roles_for("role-lookup", 4)]
    for trajectory in trajectories:
        text = trajectory.shared["q"].text
        assert len(smollm2.encode(text)) == 2048
        assert not re.search(r"\d", re.sub(r"The (access code|room number) of [A-Z]\w+ [A-Z]\w+ is \d+\.", "", text))
        answers = {a.turn_id: a for a in trajectory.task.answers}
        questions = [turn.segments[-1].text for turn in trajectory.turns]
        subject = re.search(r"What is the access code of (\w+ \w+)\?", questions[0]).group(1)
        for turn, fact, question in zip(trajectory.turns, facts, questions):
            assert f"What is the {fact} of {subject}?" in question
            gold = answers[turn.turn_id]
            sentence = FACTS[fact].text(fact, subject, gold.answer)
            assert text.count(sentence) == 1  # stated once, in the words the question uses
            share = len(smollm2.encode(text[: text.index(sentence)])) / 2048
            assert abs(gold.position - share) < 2e-3
        assert len({a.answer for a in answers.values()}) == 4  # each agent's answer is its own
    task = get_task("role-lookup")
    gold = trajectories[0].task.answers[1]
    assert task.score(f"The home city of X is {gold.answer}.\nmore", gold, trajectories[0]).correct
    assert not task.score(f"\nIt is not known.\n{gold.answer}", gold, trajectories[0]).correct  # the first line counts
    assert not task.score(f"{gold.answer}ville", gold, trajectories[0]).correct


def test_gen_trace_uses_the_template_and_refuses_what_does_not_fit(smollm2, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "t.jsonl"
    result = runner.invoke(main, ["gen-trace", "-o", str(out), "--task", "role-lookup", "--num-trajectories", "1"])
    assert result.exit_code == 0, result.output
    header = json.loads(out.read_text().splitlines()[0])
    assert header["tokenizer"] == SMOLLM2 and header["generator"]["chat_template"] is True
    assert header["generator"]["stop_at_eos"] is True
    result = runner.invoke(main, ["gen-trace", "-o", str(tmp_path / "long.jsonl"), "--task", "role-lookup",
                                  "--shared-tokens", "8192"])
    assert result.exit_code == 1
    assert "turns[0] (A0.r0): needs" in result.output and "context of 8,192 tokens" in result.output
    fits = int(re.search(r"largest --shared-tokens that fits is ([\d,]+)", result.output).group(1).replace(",", ""))
    assert not (tmp_path / "long.jsonl").exists()
    # the offered length fits exactly (the same trajectories: their questions' lengths are the same)
    result = runner.invoke(main, ["gen-trace", "-o", str(tmp_path / "fits.jsonl"), "--task", "role-lookup",
                                  "--shared-tokens", str(fits)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["gen-trace", "-o", str(tmp_path / "over.jsonl"), "--task", "role-lookup",
                                  "--shared-tokens", str(fits + 1)])
    assert result.exit_code == 1
    result = runner.invoke(main, ["gen-trace", "-o", str(tmp_path / "plain.jsonl"), "--model", SMOLLM2,
                                  "--no-chat-template", "--ignore-eos", "--num-trajectories", "1",
                                  "--shared-tokens", "100"])
    assert result.exit_code == 0, result.output
    header = json.loads((tmp_path / "plain.jsonl").read_text().splitlines()[0])
    assert header["generator"]["chat_template"] is False and header["generator"]["stop_at_eos"] is False
    result = runner.invoke(main, ["gen-trace", "-o", str(tmp_path / "x.jsonl"), "--chat-template",
                                  "--num-trajectories", "1", "--shared-tokens", "100"])  # the embedded model
    assert result.exit_code == 1 and "has no chat template" in result.output
