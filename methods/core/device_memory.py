"""A worker's memory as the KVCMAS paper counts it (peak GPU memory: model, KV cache, method state,
temporary buffers): torch's peak allocated bytes on a GPU, and everywhere the model's and the KV
pool's bytes (kvbench.contracts.DeviceMemory)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kvbench.contracts import DeviceMemory


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind `tensors`, each once (views of one buffer, tied weights)."""
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def checkpoint_bytes(model: str, dtype: torch.dtype) -> int | None:
    """The model's parameters at the served dtype, from its safetensors headers (nothing loaded);
    None where the files are not found locally."""
    from safetensors import safe_open

    folder = Path(model)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(model, local_files_only=True, allow_patterns=["*.safetensors"]))
        except Exception:  # noqa: BLE001 (not in the local cache, no hub client: no figure)
            return None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    elements = 0
    for path in files:
        with safe_open(str(path), "pt") as weights:
            for name in weights.keys():
                shape = weights.get_slice(name).get_shape()
                elements += int(torch.Size(shape).numel())
    return elements * dtype.itemsize


def loaded_weights_bytes(runner: Any) -> int:
    """The served model's weights: vLLM's own measure of what loading it took on a GPU; on a CPU
    the checkpoint's parameters at the served dtype (vLLM's CPU backend repacks linear weights
    into oneDNN handles that no tensor shows), else the tensors the model holds."""
    measured = getattr(runner, "model_memory_usage", None)
    if measured:
        return int(measured)
    config = getattr(runner, "model_config", None)
    if config is not None and (counted := checkpoint_bytes(str(config.model), config.dtype)) is not None:
        return counted
    model = getattr(runner, "model", None)
    return storage_bytes(model.parameters()) if model is not None else 0


def device_memory(weights_bytes: int, kv_caches: Iterable[torch.Tensor | None], reset: bool = False) -> DeviceMemory:
    """The worker's memory now; `reset` starts a new peak (a run's start) after reading it."""
    caches = list(kv_caches)
    device = next((t.device for t in caches if t is not None), torch.device("cpu"))
    peak = None
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
    return DeviceMemory(device=device.type, peak_allocated_bytes=peak, weights_bytes=weights_bytes,
                        kv_pool_bytes=storage_bytes(caches))
