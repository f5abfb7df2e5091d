"""Method names accepted by `--method`, and what each needs from the vLLM server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MethodInfo:
    name: str
    summary: str
    # None: plain vLLM (no connector). Otherwise the --kv-transfer-config for the server.
    kv_transfer_config: dict[str, Any] | None = None
    worker_extension_cls: str | None = None
    params: dict[str, Any] = field(default_factory=dict)


METHODS: dict[str, MethodInfo] = {
    "nonshared": MethodInfo("nonshared", "plain vLLM prefill of every prompt (vLLM's own prefix cache on)"),
}


def get_method(name: str) -> MethodInfo:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]
