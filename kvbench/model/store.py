"""Where built models live, and how a `--model` argument becomes something vLLM can load."""

from __future__ import annotations

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


def default_model_dir() -> Path:
    return model_dir_for(TinyModelSpec(), DEFAULT_SEED)


def is_built(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file()


def embedded_name(path: str | Path) -> str:
    """The portable name of a model path: `kvbench:<dir>` for cached embedded models, else the path."""
    path = Path(path)
    if path.parent == cache_root() / "models" and is_built(path):
        return EMBEDDED_PREFIX + path.name
    return str(path)


def resolve_model(model: str | None, build_if_missing: bool = True) -> str:
    """Map `--model` to what vLLM and transformers accept.

    None means the embedded default, built on first use; `kvbench:<name>` a cached embedded model.
    Anything else (a local directory or a hub name such as meta-llama/Llama-3.1-8B-Instruct) is
    passed through unchanged.
    """
    if model is not None and model.startswith(EMBEDDED_PREFIX):
        path = cache_root() / "models" / model[len(EMBEDDED_PREFIX):]
        if not is_built(path):
            if path == default_model_dir() and build_if_missing:
                return resolve_model(None)
            raise FileNotFoundError(f"embedded model {model!r} is not built on this machine ({path}); "
                                    "it was built with another kvbench version or seed: "
                                    "`kvbench model build --seed N` builds other seeds")
        return str(path)
    if model is not None:
        return model
    path = default_model_dir()
    if not is_built(path):
        if not build_if_missing:
            raise FileNotFoundError(f"the embedded model is not built yet ({path}); run `kvbench model build`")
        from kvbench.model.build import build_model

        build_model(TinyModelSpec(), DEFAULT_SEED, path)
    return str(path)
