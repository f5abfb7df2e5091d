"""kvbench:roles-adapter and its route adapters (a constructed test model): each role's reading is
in its V-only LoRA adapter, so a cache written under one adapter answers the writer's question,
and PReCache's rebuild (base values + the reader's X A B) is the reader's own cache."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path

import pytest
import torch

from kvbench.experiment import role_check
from kvbench.model.adapters import PEFT_CONFIG, merge_v_lora, v_only_problems
from kvbench.model.role_adapters import build_route_adapter
from kvbench.model.role_build import build_family_model, build_role_model
from kvbench.model.roles import FAMILIES
from kvbench.replay.prompts import PromptBuilder
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.tasks.role_recall import reading_of
from kvbench.tracegen.tokenizer import load_tokenizer


@cache
def _built(root: str) -> tuple[Path, list[Path]]:
    model_dir = Path(root) / "roles-adapter"
    build_role_model("roles-adapter", model_dir)
    return model_dir, [build_route_adapter(model_dir, Path(root) / f"route-{r}", r) for r in (0, 1)]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    return _built(str(tmp_path_factory.mktemp("roles-adapter")))


@pytest.fixture(scope="module")
def models(built: tuple[Path, list[Path]]) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    base = build_family_model(FAMILIES["roles-adapter"])[0]
    return base, [merge_v_lora(copy.deepcopy(base), folder) for folder in built[1]]


def _trajectories() -> tuple:
    tokenizer = load_tokenizer(None)
    _, trajectories = generate_trace(TraceSpec(task="role-recall", roles="role-recall", shared_tokens=600,
                                               output_len=3, num_trajectories=2, seed=5), tokenizer)
    return tokenizer, trajectories


def _prompts(tokenizer, trajectory) -> dict[str, role_check.ProbePrompt]:
    builder = PromptBuilder(tokenizer, tokenizer.prompt_prefix_ids, run_id="test")
    outputs = {a.turn_id: tokenizer.encode(a.answer + "\n") for a in trajectory.task.answers}
    return {t.turn_id: role_check.turn_prompt(builder, trajectory, t, outputs) for t in trajectory.turns}


def test_route_adapters_are_v_only_rank_8_and_recorded(built: tuple[Path, list[Path]]) -> None:
    for reading, folder in enumerate(built[1]):
        assert v_only_problems(folder) == []
        assert json.loads((folder / PEFT_CONFIG).read_text())["r"] == 8
        manifest = json.loads((folder / "kvbench-adapter.json").read_text())
        assert manifest["kind"] == "route" and manifest["reading"] == reading and manifest["constructed"] is True
    with pytest.raises(ValueError, match="roles-adapter"):  # another model has no route to put there
        tmp = built[0].parent / "transferable"
        build_role_model("roles-transferable", tmp)
        build_route_adapter(tmp, built[0].parent / "nope", 0)


def test_each_adapter_answers_its_route_and_another_adapters_cache_answers_the_writers(models) -> None:
    base, adapted = models
    tokenizer, trajectories = _trajectories()
    reused_wrong = 0
    for trajectory in trajectories:
        gold = {a.turn_id: a.answer for a in trajectory.task.answers}
        readings = {name: reading_of(agent.system) for name, agent in trajectory.agents.items()}
        prompts = _prompts(tokenizer, trajectory)
        turns = {t.turn_id: t for t in trajectory.turns}
        for turn in trajectory.turns:
            model = adapted[readings[turn.agent]]
            tokens, margins = role_check.greedy(model, prompts[turn.turn_id].ids, 3)
            assert tokenizer.decode(tokens).strip() == gold[turn.turn_id]
            assert min(margins) > 15
            source = trajectory.source_of(turn, "q")
            if source is None:
                continue
            writer = adapted[readings[turns[source].agent]]
            reused = role_check.reused_cache(model, prompts[turn.turn_id], prompts[source],
                                             role_check.dense_cache(writer, prompts[source].ids))
            answer = tokenizer.decode(role_check.greedy(model, prompts[turn.turn_id].ids, 3, reused)[0]).strip()
            reused_wrong += answer != gold[turn.turn_id]
    assert reused_wrong == 3 * len(trajectories)  # readings alternate: every reuse turn reads another route
    # without an adapter the model follows no route: no name comes out
    first = _prompts(tokenizer, trajectories[0])[trajectories[0].turns[0].turn_id]
    assert tokenizer.decode(role_check.greedy(base, first.ids, 3)[0]).strip() not in trajectories[0].shared["q"].text


@torch.no_grad()
def test_adapters_differ_only_in_the_lookup_values_and_base_plus_lr_term_is_the_readers_cache(
        built: tuple[Path, list[Path]], models) -> None:
    from safetensors.torch import load_file

    base, adapted = models
    tokenizer, trajectories = _trajectories()
    prompt = _prompts(tokenizer, trajectories[0])[trajectories[0].turns[0].turn_id]
    ids = torch.tensor([prompt.ids])
    caches = [role_check.dense_cache(m, prompt.ids) for m in (base, *adapted)]
    layers = len(caches[0].layers)
    for layer in range(layers):
        keys = [c.layers[layer].keys for c in caches]
        values = [c.layers[layer].values for c in caches]
        assert all(torch.equal(keys[0], k) for k in keys[1:])  # one key cache for every adapter
        assert all(torch.equal(values[0], v) for v in values[1:]) == (layer != layers - 1)
    # V_j = V_base + (alpha / r) (X A_j^T) B_j^T, X the value projection's input of the base pass
    captured: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda module, args, out, index=i: captured.__setitem__(index, args[0][0])) for i, layer in enumerate(base.model.layers)]
    base(input_ids=ids)
    for hook in hooks:
        hook.remove()
    last = layers - 1
    for reading, folder in enumerate(built[1]):
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        prefix = f"base_model.model.model.layers.{last}.self_attn.v_proj"
        a, b = tensors[f"{prefix}.lora_A.weight"].float(), tensors[f"{prefix}.lora_B.weight"].float()
        rebuilt = caches[0].layers[last].values[0].float().transpose(0, 1).reshape(len(prompt.ids), -1) \
            + (captured[last].float() @ a.T) @ b.T
        reader = caches[1 + reading].layers[last].values[0].float().transpose(0, 1).reshape(len(prompt.ids), -1)
        assert torch.allclose(rebuilt, reader, atol=0.05)
