"""Agents as LoRA adapters (`gen-trace --adapter ROLE=PATH`): each role's agents name an adapter,
which the trace header lists with its PEFT folder; the server loads them and every request of
an agent names its adapter as the model.

An adapter's name is its folder's name, which requests carry and vLLM's `--lora-modules` takes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvbench.tracegen.schema import Trajectory

_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


def adapter_name(path: str | Path) -> str:
    return _NAME.sub("-", Path(path).resolve().name).strip("-") or "adapter"


def peft_rank(path: str | Path) -> int:
    """The LoRA rank of the PEFT adapter folder `path` (its adapter_config.json's `r`)."""
    config = Path(path) / "adapter_config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a PEFT adapter folder (no readable adapter_config.json: {exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("r"), int):
        raise ValueError(f"{config}: no LoRA rank 'r'")
    return int(data["r"])


def check_peft_folder(path: str | Path) -> Path:
    """The folder, resolved, if it holds an adapter kvbench can serve: a PEFT LoRA adapter with
    readable weights, V-only, of the rank its config declares (kvbench.model.adapters)."""
    from kvbench.model.adapters import adapter_problems

    peft_rank(path)
    if problems := adapter_problems(path):
        raise ValueError(f"--adapter {path}: " + "; ".join(problems))
    return Path(path).resolve()


def with_adapters(trajectories: list[Trajectory], role_paths: dict[str, str]) -> tuple[dict[str, str],
                                                                                        list[Trajectory]]:
    """The header's adapter list and the trajectories whose agents of each role in `role_paths`
    name that role's adapter. Raises ValueError for a role no agent has or a folder that is not an
    adapter, and for two folders that would get one name."""
    roles = {agent.role for t in trajectories for agent in t.agents.values()}
    unknown = sorted(set(role_paths) - roles)
    if unknown:
        raise ValueError(f"--adapter: no agent has role {', '.join(map(repr, unknown))}; the trace's roles: "
                         f"{', '.join(sorted(roles))}")
    folders = {role: check_peft_folder(path) for role, path in role_paths.items()}
    names: dict[str, str] = {}
    for folder in folders.values():
        name = adapter_name(folder)
        if names.get(name, str(folder)) != str(folder):
            raise ValueError(f"--adapter: {names[name]} and {folder} would both be served as {name!r}; rename one")
        names[name] = str(folder)
    by_role = {role: adapter_name(folder) for role, folder in folders.items()}
    updated = [t.model_copy(update={"agents": {key: agent.model_copy(update={"adapter": by_role.get(agent.role)})
                                               for key, agent in t.agents.items()}})
               for t in trajectories]
    return names, updated
