"""Building the role-family models (kvbench.model.roles): the circuit installed into a Llama of
RoleModelSpec's shape, saved with its manifest and checked against the recorded weights."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvbench import __version__
from kvbench.model.roles import FAMILIES, ROLES_RECIPE_VERSION, Family, LayerPlan, RoleModelSpec, install, role_tokens

# The weights each family must build to (sha256 over names, dtypes, shapes and bytes): a build
# that differs is refused, so reports made with a family name the same model everywhere.
WEIGHTS_SHA256: dict[str, str] = {
    "roles-transferable": "d20aff58314fd41241794b7cac44297f3ad94a83ac5fc172aa8712870c76b377",
    "roles-sparse": "3ada6e882dec78037d6bc6954d8f06bd04376dcbdf95d4d3aa51d89d12e17ff4",
    "roles-deep": "04fd7baa4cfedf873be767191f9b1dbfbb7195843c3da2ba77012189594586de",
    "roles-content-bound": "b94d358dd3d349db2631322ad876f8d303c0a861ad5c5f3e34ff427fe17c16ed",
    "roles-adapter": "0ad567d597094c1dbe850459957bec0682a04c822615040a4e4a503cce493a4b",
}



def _recall_tokenizer() -> Any:
    from tokenizers import Tokenizer

    from kvbench.model.store import RECALL_MODEL, SHIPPED_DIR

    return Tokenizer.from_file(str(SHIPPED_DIR / RECALL_MODEL / "tokenizer.json"))


def build_family_model(family: Family, spec: RoleModelSpec | None = None) -> tuple[torch.nn.Module, Any, LayerPlan]:
    """The family's model (fp32, in memory) and its tokenizer."""
    from transformers import LlamaForCausalLM

    from kvbench.model.build import llama_config

    spec = spec or RoleModelSpec()
    tokenizer = _recall_tokenizer()
    model = LlamaForCausalLM(llama_config(spec, tokenizer.get_vocab(), tie_word_embeddings=False)).eval()
    plan = install(model, family, role_tokens(tokenizer))
    return model, tokenizer, plan


def build_role_model(name: str, out_dir: Path) -> dict[str, Any]:
    """Build family `name` into `out_dir` (atomically), check its weights, return the manifest."""
    from transformers.utils import logging as hf_logging

    from kvbench.model.build import save_model_dir

    hf_logging.disable_progress_bar()
    family = FAMILIES[name]
    spec = RoleModelSpec()
    model, tokenizer, plan = build_family_model(family, spec)
    manifest = save_model_dir(model, tokenizer, spec.max_position_embeddings, out_dir, {
        "name": name,
        "recipe": "roles",
        "recipe_version": ROLES_RECIPE_VERSION,
        "constructed": True,
        "family": dataclasses.asdict(family),
        "spec": dataclasses.asdict(spec),
        "layers": dataclasses.asdict(plan),
        # The first layer whose K/V depend on tokens beyond a row's few neighbours (the role's
        # route): selective recomputation checks deviations there (kvbench.model.store).
        "first_context_layer": plan.first_context_layer,
        "task": "role-recall",
        "kvbench_version": __version__,
        "torch_version": torch.__version__,
    })
    expected = WEIGHTS_SHA256.get(name)
    if expected is not None and manifest["weights_sha256"] != expected:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise ValueError(f"kvbench:{name} built to weights sha256 {manifest['weights_sha256'][:16]}..., not the "
                         f"recorded {expected[:16]}...: this kvbench's recipe or torch rounds differently; "
                         "reports made with the recorded weights do not apply to this build")
    return manifest


def family_of(model_dir: str | Path) -> Family | None:
    """The role family of a built model directory, None for any other model."""
    from kvbench.model.store import MANIFEST_NAME

    try:
        manifest = json.loads((Path(model_dir) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return FAMILIES.get(manifest.get("name", "")) if manifest.get("recipe") == "roles" else None


def family_names() -> Sequence[str]:
    return tuple(FAMILIES)
