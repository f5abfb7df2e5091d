"""Where built models live, and how a `--model` argument becomes something vLLM can load."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvbench.model.spec import TinyModelSpec

DEFAULT_SEED = 0
# Marker that a model directory was completely written (builds write to a temp dir, then rename).
MANIFEST_NAME = "kvbench-model.json"
# Portable name of a cached embedded model in trace headers and results: "kvbench:<dir name>".
EMBEDDED_PREFIX = "kvbench:"


def cache_root() -> Path:
    """`$KVBENCH_CACHE_DIR`, else `$XDG_CACHE_HOME/kvbench`, else `~/.cache/kvbench`."""
    if env := os.environ.get("KVBENCH_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvbench"


def model_dir_for(spec: TinyModelSpec, seed: int) -> Path:
    return cache_root() / "models" / f"tiny-llama-{spec.digest()}-seed{seed}"


def tiny_model_dir() -> Path:
    """The old embedded model (4 layers, standard library, built on first use): `kvbench:tiny`."""
    return model_dir_for(TinyModelSpec(), DEFAULT_SEED)


def default_model_dir() -> Path:
    """The embedded default: the shipped recall model (kvbench/model/weights/recall-v1)."""
    return SHIPPED_DIR / RECALL_MODEL


def is_built(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file()


def first_context_layer(model_path: str | Path) -> int:
    """The first decoder layer whose K/V can depend on tokens other than their own row's few
    neighbours, i.e. where reusing another agent's cache of a segment can be wrong beyond its first
    rows: 1 in a standard transformer (layer 0 projects token embeddings alone); after the hand-set
    circuit in kvbench's recall model, whose layers attend only to the ~10 preceding tokens
    (manifest `circuit.layers`). Tests and benchmarks measure reuse error from this layer on, where
    the earlier, context-free layers would only dilute it."""
    manifest = Path(model_path) / MANIFEST_NAME
    if not manifest.is_file():
        return 1
    recorded = json.loads(manifest.read_text())
    if "first_context_layer" in recorded:  # constructed models say where (kvbench.model.roles)
        return int(recorded["first_context_layer"])
    circuit_layers = recorded.get("circuit", {}).get("layers", [])
    return max(1, max(circuit_layers, default=-1) + 1)


def embedded_name(path: str | Path) -> str:
    """The portable name of a model path: `kvbench:<dir>` for cached embedded models, else the path."""
    path = Path(path)
    if path.parent in (cache_root() / "models", SHIPPED_DIR) and is_built(path):
        return EMBEDDED_PREFIX + path.name
    return str(path)


def model_identity(model: str | None) -> str | None:
    """What makes two runs' models the same: an embedded model's name and weights digest (from its
    manifest, wherever the checkout or cache holding it lies), else the name or path as given."""
    if model is None:
        return None
    manifest = Path(model) / MANIFEST_NAME
    try:
        recorded = json.loads(manifest.read_text())
        return f"{EMBEDDED_PREFIX}{recorded['name']}@{recorded['weights_sha256']}"
    except (OSError, ValueError, KeyError):
        return model


# Models whose weights ship inside the package (kvbench/model/weights/<name>): every machine runs
# the same bytes, and nothing is trained on a fresh install. `kvbench model build --recipe` rebuilds.
SHIPPED_DIR = Path(__file__).parent / "weights"
RECALL_MODEL = "recall-v1"
TINY_ALIAS = "tiny"


def shipped_models() -> dict[str, Path]:
    return {p.name: p for p in sorted(SHIPPED_DIR.iterdir()) if is_built(p)} if SHIPPED_DIR.is_dir() else {}


ROLES_PREFIX = "roles-"


def is_constructed(name: str) -> bool:
    """Whether a model name (`kvbench:<name>`) is one of kvbench's wholly constructed test models."""
    return name.startswith(EMBEDDED_PREFIX + ROLES_PREFIX)
