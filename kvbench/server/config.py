"""What a vLLM server is started with: `ServerConfig`, the flags it becomes, and the server a
sharing method needs (`method_server_config`: plain vLLM, or vLLM with kvbench's connector)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.contracts import WorkerRpc
from kvbench.methods.api.spec import ChosenMethod
from kvbench.methods.core.mooncake_tier import SharedTierSettings
from kvbench.server.errors import ServerError
from kvbench.tracegen.adapters import peft_rank

SHUTDOWN_TIMEOUT_S = 10  # vLLM's own drain on SIGTERM; VLLMServer.stop waits longer before SIGKILL


ENFORCE_EAGER_ENV = "KVBENCH_ENFORCE_EAGER"


@dataclass
class ServerConfig:
    model: str
    host: str = "127.0.0.1"
    port: int | None = None  # None: pick a free port
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    # vLLM's CPU backend sizes its KV pool from this (GiB); ignored on GPU.
    cpu_kv_cache_gib: float = 2.0
    kv_transfer_config: dict[str, Any] | None = None
    worker_extension_cls: str | None = None
    extra_args: list[str] = field(default_factory=list)
    # Worker-extension methods called over /collective_rpc once the server is healthy.
    post_start_rpcs: list[WorkerRpc] = field(default_factory=list)
    startup_timeout_s: float = 600.0
    # vLLM's drain on SIGTERM before it kills its engine; VLLMServer.stop waits 10 s more.
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S
    # LoRA adapters to serve (a trace's `adapters`: name -> PEFT folder): --enable-lora and the rest.
    lora_modules: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    # This instance's own share of the machine (kvbench.server.instances): CPU cores on the CPU
    # backend (its processes pinned to them), GPU ids on GPU (CUDA_VISIBLE_DEVICES). None: all.
    devices: list[int] | None = None
    # The shared tier under the connector's segment store (several instances, one Mooncake Store).
    shared_tier: SharedTierSettings | None = None
    # vLLM's --enforce-eager: no torch.compile warm-up or CUDA graphs. Starts in about a quarter of
    # the time on the embedded models and decodes slower, so it suits tests and smoke runs, where
    # starts dominate, and not measurements. Default: the KVBENCH_ENFORCE_EAGER environment
    # variable ("1": on), which the engine test tier sets.
    enforce_eager: bool = field(default_factory=lambda: os.environ.get(ENFORCE_EAGER_ENV, "") == "1")


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's --max-lora-rank accepts


def lora_args(modules: dict[str, str]) -> list[str]:
    """vLLM's arguments to serve LoRA adapters (PEFT folders): every adapter loaded at once, the
    rank cap the largest one needs (from its adapter_config.json)."""
    ranks = []
    for name, path in modules.items():
        try:
            ranks.append(peft_rank(path))
        except ValueError as exc:
            raise ServerError(f"adapter {name!r}: {path} is not a PEFT adapter config with a rank 'r' ({exc})") from None
    rank = next((r for r in VLLM_LORA_RANKS if r >= max(ranks)), max(ranks))
    return ["--enable-lora", "--max-loras", str(len(modules)), "--max-lora-rank", str(rank),
            "--lora-modules", *(f"{name}={path}" for name, path in modules.items())]


def cpu_kv_cache_bytes(gib: float) -> int:
    """vLLM CPU's KV pool in bytes, for `--kv-cache-memory-bytes` (fractions of a GiB work)."""
    if not gib > 0:
        raise ServerError(f"the CPU KV cache must be larger than 0 GiB, got {gib}")
    return int(gib * 2**30)


def tensor_parallel_size(args: list[str]) -> int:
    """The --tensor-parallel-size (-tp) among vLLM arguments (1 when absent or not a number:
    vLLM itself reports a bad value)."""
    for index, arg in enumerate(args):
        for flag in ("--tensor-parallel-size", "-tp"):
            value = args[index + 1] if arg == flag and index + 1 < len(args) else \
                arg.split("=", 1)[1] if arg.startswith(flag + "=") else None
            if value is not None:
                return int(value) if value.isdigit() else 1
    return 1


def cpu_binding(cores: list[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` CPU workers: the cores split into contiguous shares,
    e.g. "0,1|2,3"."""
    if len(cores) < ranks:
        raise ServerError(f"tensor parallelism over {ranks} CPU workers needs at least {ranks} cores; "
                          f"this process may use {len(cores)}")
    shares = [cores[len(cores) * r // ranks: len(cores) * (r + 1) // ranks] for r in range(ranks)]
    return "|".join(",".join(str(c) for c in share) for share in shares)


def reserved_cpu_cores(cores: int, ranks: int) -> int:
    """VLLM_CPU_NUM_OF_RESERVED_CPU: the cores vLLM's CPU backend keeps from its workers for the
    engine-core process, set to the same count for every method. Left to vLLM, it keeps one per
    rank, plus one more per rank when any KV connector is configured (meant for NIXL): on a
    2-core machine NonShared's worker got one core and every connector method's worker both
    (more cores than there are to reserve: vLLM then keeps none), and an 8K prefill took 2.2 s
    against 1.15 s for the same request. kvbench keeps plain vLLM's one per rank, or none where
    that would leave a rank fewer than two cores."""
    return ranks if cores - ranks >= 2 * ranks else 0


def method_server_config(method: ChosenMethod, model: str, max_load_tokens_per_step: int = 0,
                         max_store_bytes: int | None = None,
                         fault_injection: str | None = None, **options: Any) -> ServerConfig:
    """A server for a sharing method: plain vLLM, or vLLM with the kvbench connector, its worker
    extension and the model handed to the connector once the server is up. Every server gets the
    worker extension: its memory RPC (WorkerRpc.MEMORY) needs no connector. The connector's
    settings (load spreading, store cap, injected faults) mean nothing to plain vLLM and are
    left out for it."""
    from kvbench.methods.registry import WORKER_EXTENSION, kv_transfer_config

    uses_connector = method.spec.uses_connector
    transfer = kv_transfer_config(method, max_load_tokens_per_step=max_load_tokens_per_step if uses_connector else None,
                                  max_store_bytes=max_store_bytes if uses_connector else None,
                                  fault_injection=fault_injection if uses_connector else None)
    return ServerConfig(model=model, kv_transfer_config=transfer,
                        worker_extension_cls=WORKER_EXTENSION,
                        post_start_rpcs=[WorkerRpc.ATTACH_MODEL] if uses_connector else [], **options)
