"""A run's memory as the KVCMAS paper counts it, from what its servers' workers reported
(WorkerRpc.MEMORY, sampled at a segment's start and end: replay/server_metrics.py) and what the
connector's stats say of its store and method state.

- `peak_gpu_memory_gib`: on a GPU, the peak of torch's allocated bytes over the run (model, KV
  pool, method state, every temporary buffer of the correction), summed over a server's
  tensor-parallel ranks; the largest over the run's servers.
- `peak_cpu_tensor_memory_gib`: the CPU twin, the parts measured from their tensors: model weights,
  KV pool, the store's and the method state's peaks. Temporary buffers are not in it (torch keeps
  no peak on a CPU), nor the interpreter's and vLLM's own allocations (server RSS counts those).
- `memory_parts_gib`: those parts, and on a GPU what the peak holds beyond them (`other`)."""

from __future__ import annotations

from typing import Any

GIB = 2**30


def segment_device_memory(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One segment's worker answers, per server the last (end of segment): ranks summed; the
    server with the largest footprint. None when no server answered."""
    last: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        if sample.get("device_memory"):
            last[sample["server_url"]] = sample["device_memory"]
    servers = []
    for ranks in last.values():
        peaks = [r["peak_allocated_bytes"] for r in ranks if r.get("peak_allocated_bytes") is not None]
        servers.append({"device": ranks[0]["device"], "weights_bytes": sum(r["weights_bytes"] for r in ranks),
                        "kv_pool_bytes": sum(r["kv_pool_bytes"] for r in ranks),
                        "peak_allocated_bytes": sum(peaks) if peaks else None})
    if not servers:
        return None
    return max(servers, key=lambda s: (s["peak_allocated_bytes"] or 0, s["weights_bytes"] + s["kv_pool_bytes"]))


def memory_figures(device: dict[str, Any] | None, store_peak_bytes: int | None,
                   method_state_bytes: dict[str, int] | None) -> dict[str, Any]:
    """The summary's memory keys (None where nothing was reported)."""
    if device is None:
        return {"peak_gpu_memory_gib": None, "peak_cpu_tensor_memory_gib": None, "memory_parts_gib": None}
    state = method_state_bytes or {}
    peaks = {k[len("peak_"):]: v for k, v in state.items() if k.startswith("peak_")}
    state_bytes = sum({**{k: v for k, v in state.items() if not k.startswith("peak_")}, **peaks}.values())
    parts = {"model_weights": device["weights_bytes"], "kv_pool": device["kv_pool_bytes"],
             "store": store_peak_bytes or 0, "method_state": state_bytes}
    measured = sum(parts.values())
    gpu = device["peak_allocated_bytes"] if device["device"] == "cuda" else None
    if gpu is not None:
        parts["other"] = max(gpu - measured, 0)  # temporary buffers, activations, vLLM's own
    return {"peak_gpu_memory_gib": gpu / GIB if gpu is not None else None,
            "peak_cpu_tensor_memory_gib": measured / GIB if gpu is None else None,
            "memory_parts_gib": {name: value / GIB for name, value in parts.items()}}
