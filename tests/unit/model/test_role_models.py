"""The role-family models (kvbench.model.roles), measured in transformers on their own weights:
each answers role-recall under dense prefill with a margin bf16 cannot flip, naive reuse answers
the other route, and each family's defining property holds (where the cross-role delta lives,
in which layers, of what rank, and whether it carries over between contents). Unit tier: the
models are constructed (about a second each), not trained, and no vLLM engine runs."""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch

from kvbench.experiment import role_check
from kvbench.model.role_build import WEIGHTS_SHA256, build_family_model, build_role_model
from kvbench.model.roles import FAMILIES, PROMPT_FAMILIES
from kvbench.replay.prompts import PromptBuilder
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.tokenizer import load_tokenizer

CONTEXT = 600
LAYERS = 8


@cache
def _model(name: str) -> torch.nn.Module:
    return build_family_model(FAMILIES[name])[0]


@cache
def _trace() -> tuple:
    tokenizer = load_tokenizer(None)
    _, trajectories = generate_trace(TraceSpec(task="role-recall", roles="role-recall", shared_tokens=CONTEXT,
                                               output_len=3, num_trajectories=3, seed=4), tokenizer)
    return tokenizer, trajectories


def _prompts(trajectory) -> dict[str, role_check.ProbePrompt]:
    """Every turn's prompt, reference-anchored: notes hold the gold answers."""
    tokenizer, _ = _trace()
    builder = PromptBuilder(tokenizer, tokenizer.prompt_prefix_ids, run_id="test")
    outputs = {a.turn_id: tokenizer.encode(a.answer + "\n") for a in trajectory.task.answers}
    return {t.turn_id: role_check.turn_prompt(builder, trajectory, t, outputs) for t in trajectory.turns}


def _structure(name: str, trajectory) -> role_check.DeltaStructure:
    prompts = _prompts(trajectory)
    model = _model(name)
    return role_check.delta_structure(role_check.shared_rows(model, prompts["A0.r0"]),
                                      role_check.shared_rows(model, prompts["A1.r0"]))


def _delta(name: str, trajectory) -> torch.Tensor:
    prompts = _prompts(trajectory)
    model = _model(name)
    (k0, v0), (k1, v1) = (role_check.shared_rows(model, prompts[t]) for t in ("A0.r0", "A1.r0"))
    return torch.cat([k1 - k0, v1 - v0], dim=-1)


@pytest.mark.parametrize("name", PROMPT_FAMILIES)
def test_dense_answers_are_right_and_naive_reuse_answers_the_other_route(name: str) -> None:
    tokenizer, trajectories = _trace()
    model = _model(name)
    for trajectory in trajectories:
        gold = {a.turn_id: a.answer for a in trajectory.task.answers}
        prompts = _prompts(trajectory)
        sources = {t.turn_id: trajectory.source_of(t, "q") for t in trajectory.turns}
        for turn in trajectory.turns:
            prompt = prompts[turn.turn_id]
            tokens, margins = role_check.greedy(model, prompt.ids, 3)
            assert tokenizer.decode(tokens).strip() == gold[turn.turn_id]
            assert min(margins) > 15  # nats: a bf16 rounding or a batch's reordering moves logits by < 1
            source = sources[turn.turn_id]
            if source is None:
                continue
            reused = role_check.reused_cache(model, prompt, prompts[source], role_check.dense_cache(model, prompts[source].ids))
            tokens, _ = role_check.greedy(model, prompt.ids, 3, reused)
            # consecutive agents follow different routes: the source's route from the right record
            answer = tokenizer.decode(tokens).strip()
            assert answer != gold[turn.turn_id]
            key = gold[source]  # the record this turn reads
            table = trajectory.shared["q"].text
            assert f"\n{key} -> {answer}" in table or f"\n{key} >> {answer}" in table


def test_transferable_delta_is_one_vector_per_token_class() -> None:
    _, trajectories = _trace()
    structure = _structure("roles-transferable", trajectories[0])
    # written at layer 0, it shows in every later layer's K/V: one direction per layer
    assert [layer for layer, n in enumerate(structure.relative_norm_by_layer) if n > 1e-3] == list(range(1, LAYERS))
    assert all(rank == 1 for rank in structure.effective_rank_by_layer[1:])
    assert structure.token_share > 0.25  # a 15% selection of tokens cannot hold it
    deltas = [_delta("roles-transferable", t) for t in trajectories]
    assert role_check.transfer_error(deltas[0], deltas[1]) < 0.01  # carries over to another content
    assert role_check.transfer_error(deltas[1], deltas[2]) < 0.01


def test_sparse_delta_lives_in_few_tokens() -> None:
    _, trajectories = _trace()
    structure = _structure("roles-sparse", trajectories[0])
    assert 0.03 < structure.token_share <= 0.15
    assert [layer for layer, n in enumerate(structure.relative_norm_by_layer) if n > 1e-3] == list(range(2, LAYERS))
    deltas = [_delta("roles-sparse", t) for t in trajectories]
    assert role_check.transfer_error(deltas[0], deltas[1]) > 1.0  # and depends on the names


def test_deep_delta_is_only_in_the_last_layers() -> None:
    _, trajectories = _trace()
    structure = _structure("roles-deep", trajectories[0])
    assert all(n < 1e-4 for n in structure.relative_norm_by_layer[:LAYERS - 1])
    assert structure.relative_norm_by_layer[LAYERS - 1] > 0.1
    assert structure.token_share > 0.25


def test_content_bound_delta_does_not_carry_over() -> None:
    _, trajectories = _trace()
    structure = _structure("roles-content-bound", trajectories[0])
    assert structure.token_share > 0.25
    deltas = [_delta("roles-content-bound", t) for t in trajectories]
    # unrelated deltas: ||a - b|| ~ sqrt(2) ||a||; a correction from another content is as wrong as none
    assert role_check.transfer_error(deltas[0], deltas[1]) > 1.2
    assert role_check.transfer_error(deltas[1], deltas[2]) > 1.2


@pytest.mark.parametrize("name", list(FAMILIES))
def test_builds_are_the_recorded_weights(name: str, tmp_path) -> None:
    manifest = build_role_model(name, tmp_path / name)
    assert manifest["weights_sha256"] == WEIGHTS_SHA256[name]
    first = {"roles-deep": 7, "roles-sparse": 2, "roles-adapter": 7}.get(name, 1)  # the layer after the route is written
    assert manifest["constructed"] is True and manifest["first_context_layer"] == first
    assert json.loads((tmp_path / name / "kvbench-model.json").read_text())["name"] == name


def test_unknown_family_is_refused_with_the_list() -> None:
    from kvbench.model.resolve import resolve_model

    with pytest.raises(FileNotFoundError, match="kvbench:roles-transferable"):
        resolve_model("kvbench:roles-shallow")


def test_model_check_figures_of_a_family() -> None:
    """`kvbench model check` on a role family (small settings): what reuse costs, and its format."""
    from dataclasses import asdict

    from kvbench.experiment.family_check import FamilyCheckSettings, format_family_check, offline_family_figures

    settings = FamilyCheckSettings(model="kvbench:roles-content-bound", context=CONTEXT, trajectories=2)
    figures = offline_family_figures(settings)
    assert figures["reuse_turns"] == 6
    assert figures["nonshared_accuracy_reuse"] == 1.0 and figures["fullshared_accuracy_reuse"] == 0.0
    assert min(figures["margin_min"].values()) > 15
    assert figures["delta_transfer_error"] > 1.2 and figures["delta_token_share"] > 0.25
    assert figures["delta_effective_rank_by_layer"][0] == 0 and figures["delta_effective_rank_by_layer"][2] > 0
    text = format_family_check({"model": settings.model, "family": asdict(FAMILIES["roles-content-bound"]),
                                "settings": asdict(settings), **figures})
    assert "constructed test model" in text and "naive reuse (FullShared) 0%" in text
