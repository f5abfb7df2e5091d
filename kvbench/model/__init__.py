"""The embedded default model: a tiny Llama-architecture model kvbench builds itself."""

from kvbench.model.resolve import resolve_model
from kvbench.model.spec import TinyModelSpec
from kvbench.model.store import default_model_dir

__all__ = ["TinyModelSpec", "default_model_dir", "resolve_model"]
