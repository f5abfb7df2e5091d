"""Memory as the KVCMAS paper counts it: each storage once (tied weights, a KV pool of views), a
GPU's peak from torch, and the summary's figures from the parts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvbench.analysis.device_memory import GIB, memory_figures, segment_device_memory
from kvbench.methods.core.device_memory import checkpoint_bytes, device_memory, loaded_weights_bytes, storage_bytes


def test_each_storage_is_counted_once() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head and its embedding often are
    assert storage_bytes(model.parameters()) == 10 * 4 * 4
    pool = torch.zeros(2, 8, 4, dtype=torch.bfloat16)  # one buffer, one view per layer
    memory = device_memory(123, [pool[0], pool[1], None])
    assert memory.device == "cpu" and memory.peak_allocated_bytes is None
    assert memory.weights_bytes == 123 and memory.kv_pool_bytes == pool.nbytes
    assert storage_bytes([torch.zeros(3), torch.zeros(3)]) == 24  # two buffers, two counts


def test_weights_are_vllms_own_measure_else_the_checkpoint_at_the_served_dtype(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(10, 4), "b": torch.zeros(6)}, str(tmp_path / "model.safetensors"))  # fp32 on disk
    assert checkpoint_bytes(str(tmp_path), torch.bfloat16) == 46 * 2  # served in bf16
    assert checkpoint_bytes(str(tmp_path / "nowhere"), torch.bfloat16) is None
    gpu_runner = SimpleNamespace(model_memory_usage=5000, model_config=None)
    cpu_runner = SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path), dtype=torch.float16))
    assert loaded_weights_bytes(gpu_runner) == 5000 and loaded_weights_bytes(cpu_runner) == 92


def test_the_summary_figures_add_the_parts_and_the_gpu_peak_holds_them() -> None:
    ranks = [{"device": "cpu", "peak_allocated_bytes": None, "weights_bytes": 2 * GIB, "kv_pool_bytes": GIB}] * 2
    samples = [{"server_url": "a", "device_memory": ranks}, {"server_url": "b"}]
    device = segment_device_memory(samples)
    assert device == {"device": "cpu", "weights_bytes": 4 * GIB, "kv_pool_bytes": 2 * GIB, "peak_allocated_bytes": None}
    figures = memory_figures(device, GIB // 2, {"anchor_pool": GIB // 4, "peak_anchor_pool": GIB // 2})
    assert figures["peak_gpu_memory_gib"] is None and figures["peak_cpu_tensor_memory_gib"] == 7.0  # 4 + 2 + .5 + .5
    gpu = memory_figures({**device, "device": "cuda", "peak_allocated_bytes": 8 * GIB}, 0, {})
    assert gpu["peak_gpu_memory_gib"] == 8.0 and gpu["peak_cpu_tensor_memory_gib"] is None
    assert gpu["memory_parts_gib"]["other"] == 2.0  # what the peak holds beyond the measured parts
    assert memory_figures(None, None, None)["memory_parts_gib"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_peak_counts_temporary_buffers_and_restarts_on_reset() -> None:
    device = torch.device("cuda")
    pool = torch.zeros(1024, 1024, device=device)
    device_memory(0, [pool], reset=True)
    temporary = torch.ones(4096, 1024, device=device)  # 16 MiB, freed before the reading
    del temporary
    peak = device_memory(0, [pool]).peak_allocated_bytes
    assert peak is not None and peak >= pool.nbytes + 16 * 2**20
    after_reset = device_memory(0, [pool], reset=True)
    assert device_memory(0, [pool]).peak_allocated_bytes < after_reset.peak_allocated_bytes  # type: ignore[operator]


def test_a_tensor_parallel_gpu_peak_adds_its_ranks_and_takes_the_largest_server() -> None:
    """Each rank's torch peak is its own device's: a server's is their sum; the run's is its
    largest server's, read from each server's last answer (the peak since the segment's start)."""
    def ranks(*peaks_gib: float) -> list[dict]:
        return [{"device": "cuda", "peak_allocated_bytes": int(p * GIB), "weights_bytes": GIB, "kv_pool_bytes": GIB}
                for p in peaks_gib]

    samples = [{"server_url": "a", "device_memory": ranks(1, 1)},  # the segment's start: superseded
               {"server_url": "b", "device_memory": ranks(2, 2.5)},
               {"server_url": "a", "device_memory": ranks(3, 5)}]
    device = segment_device_memory(samples)
    assert device is not None and device["peak_allocated_bytes"] == 8 * GIB  # a's two ranks, 3 + 5
    assert device["weights_bytes"] == 2 * GIB and device["kv_pool_bytes"] == 2 * GIB
    figures = memory_figures(device, 0, {})
    assert figures["peak_gpu_memory_gib"] == 8.0 and figures["memory_parts_gib"]["other"] == 4.0
