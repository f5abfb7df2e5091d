"""Method names accepted by `--method`, and what each needs from the vLLM server.

Kept free of torch/vLLM imports so that the CLI can validate names cheaply; the implementation
classes are imported by the connector inside the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONNECTOR_CLASS = "KVBenchConnector"
CONNECTOR_MODULE = "kvbench.methods.connector"
WORKER_EXTENSION = "kvbench.methods.worker_ext.KVBenchWorkerExtension"


@dataclass(frozen=True)
class MethodInfo:
    name: str
    summary: str
    impl: str | None = None  # "module.Class" of the SharingMethod; None = plain vLLM, no connector
    approximate: bool = False  # placed K/V differ from dense: requests get a cache_salt

    @property
    def uses_connector(self) -> bool:
        return self.impl is not None


METHODS: dict[str, MethodInfo] = {m.name: m for m in [
    MethodInfo("nonshared", "plain vLLM prefill of every prompt (vLLM's own prefix cache still reuses each "
               "agent's own prefix)"),
    MethodInfo("fullshared", "reuse the source agent's K/V of every shared segment, re-aligned, no correction",
               impl="kvbench.methods.fullshared.FullShared", approximate=True),
    MethodInfo("kvcmas", "chained low-rank delta correction from an online anchor pool (V=10, r=32, tau=0.3)",
               impl="kvbench.methods.kvcmas.KVCMAS", approximate=True),
    MethodInfo("kvcmas-nonchained", "KVCMAS corrected from a context-free reference (Fig. 6 ablation)",
               impl="kvbench.methods.kvcmas_nonchained.KVCMASNonChained", approximate=True),
    MethodInfo("kvcomm", "non-chained full-dimensional anchors from a context-free reference (V=20, gamma=0.3)",
               impl="kvbench.methods.kvcomm.KVComm", approximate=True),
    MethodInfo("cacheblend", "reuse, then recompute the 15% of reused tokens whose values deviate most at layer 1 "
               "through the later layers", impl="kvbench.methods.cacheblend.CacheBlend", approximate=True),
    MethodInfo("droidspeak", "reuse, then recompute one contiguous layer group for all shared tokens from the "
               "source's saved residual stream (deepest 20% of layers, at least 2)",
               impl="kvbench.methods.droidspeak.DroidSpeak", approximate=True),
    MethodInfo("relaycaching", "reuse, compute every reused row through det_layer (1), then only those whose values "
               "deviate or that the prompt's tail attends to, up to end_layer", impl="kvbench.methods.relaycaching.RelayCaching",
               approximate=True),
    MethodInfo("graphflow", "one calibrated correction per (slot, target agent), no online matching",
               impl="kvbench.methods.graphflow.GraphFlow", approximate=True),
]}


def get_method(name: str) -> MethodInfo:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def kv_transfer_config(name: str, params: dict[str, Any] | None = None, max_store_bytes: int | None = None,
                       fault_injection: str | None = None,
                       max_load_tokens_per_step: int | None = None) -> dict[str, Any] | None:
    """The server's --kv-transfer-config for a method (None for plain vLLM)."""
    info = get_method(name)
    if not info.uses_connector:
        if params:
            raise ValueError(f"method {name!r} takes no parameters")
        return None
    extra: dict[str, Any] = {"method": name, "params": dict(params or {})}
    if max_store_bytes is not None:
        extra["max_store_bytes"] = max_store_bytes
    if fault_injection is not None:
        extra["fault_injection"] = fault_injection
    if max_load_tokens_per_step:
        extra["max_load_tokens_per_step"] = max_load_tokens_per_step
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # On any connector failure vLLM recomputes the request's blocks itself (dense fallback).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def method_class(name: str) -> type:
    """The SharingMethod subclass implementing a connector method (imports torch)."""
    import importlib

    info = get_method(name)
    if info.impl is None:
        raise ValueError(f"method {name!r} runs without the connector")
    module, _, cls = info.impl.rpartition(".")
    return getattr(importlib.import_module(module), cls)


def validate_params(name: str, params: dict[str, Any]) -> None:
    """Check a method's parameters before a server is started for it (raises ValueError)."""
    if get_method(name).uses_connector:
        method_class(name)(params)
    elif params:
        raise ValueError(f"method {name!r} takes no parameters")
