"""kvbench: benchmarking and trace replay for cross-agent KV-cache sharing in vLLM."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvbench")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"
