"""The vLLM server options shared by every command that starts a server (replay, serve,
calibrate), gathered into one value so that a new option is added in one place."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from kvbench.cli.param_types import FiniteFloatRange, option_group
from kvbench.methods.api.spec import ChosenMethod

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class ByteSize(click.ParamType):
    """A byte count: an integer, or a number with a unit (32MiB, 1.5GiB, 500MB)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS or (size := int(float(match.group(1)) * _UNITS[unit])) <= 0:
            self.fail(f"expected a positive size such as 33554432, 32MiB or 4GiB, got {value!r}", param, ctx)
        return size


class FaultMode(click.ParamType):
    name = "mode"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value).strip().lower()
        if text == "all":
            return text
        try:
            fraction = float(text)
        except ValueError:
            fraction = -1.0
        if not 0 < fraction <= 1:
            self.fail(f"expected 'all' or a fraction of the loads in (0, 1], got {value!r}", param, ctx)
        return repr(fraction)


@dataclass(frozen=True)
class ServerOptions:
    model: str | None  # as given: None means the trace's model, else the embedded one
    max_model_len: int | None
    cpu_kv_cache_gib: float
    startup_timeout_s: float
    method_params: tuple[str, ...]  # KEY=VALUE, parsed by the command (it validates them)
    vllm_args: tuple[str, ...]
    max_load_tokens_per_step: int
    max_store_bytes: int | None
    fault_injection: str | None

    def server_config(self, method: ChosenMethod, served_model: str, *, host: str = "127.0.0.1",
                      port: int | None = None, log_path: Path | None = None,
                      lora_modules: dict[str, str] | None = None) -> Any:
        """The ServerConfig of a vLLM server running `method` (with its parameters) for `served_model`
        (and the LoRA adapters a trace's agents use)."""
        from kvbench.server.config import method_server_config

        return method_server_config(method, served_model, host=host, port=port, lora_modules=lora_modules or {},
                                    max_model_len=self.max_model_len, cpu_kv_cache_gib=self.cpu_kv_cache_gib,
                                    extra_args=list(self.vllm_args), startup_timeout_s=self.startup_timeout_s,
                                    log_path=log_path, max_load_tokens_per_step=self.max_load_tokens_per_step,
                                    max_store_bytes=self.max_store_bytes, fault_injection=self.fault_injection)


_OPTIONS = [
    click.option("--model", default=None,
                 help="Model to serve (path or hub name) [default: the trace's model, else the embedded one]."),
    click.option("--max-model-len", type=click.IntRange(min=16), default=None, help="vLLM --max-model-len."),
    click.option("--cpu-kv-cache-gib", type=FiniteFloatRange(min=0, min_open=True), default=2.0, show_default=True,
                 help="KV pool of vLLM's CPU backend (passed as --kv-cache-memory-bytes, so fractions work); "
                      "ignored on GPU."),
    click.option("--server-startup-timeout", "startup_timeout_s", type=FiniteFloatRange(min=1), default=600.0,
                 show_default=True, help="Seconds to wait for the server's /health."),
    click.option("--method-param", "method_params", multiple=True, metavar="KEY=VALUE",
                 help="Method parameter (repeatable; VALUE is parsed as JSON when it can be), passed to "
                      "the server's kv_connector_extra_config."),
    click.option("--vllm-arg", "vllm_args", multiple=True, metavar="ARG",
                 help="Extra argument passed to the vLLM server verbatim (repeatable), e.g. "
                      "--vllm-arg=--gpu-memory-utilization=0.8."),
    click.option("--max-load-tokens-per-step", type=click.IntRange(min=0), default=0, show_default=True,
                 help="Spread each request's cache materialization over engine steps: every step runs "
                      "partial-forward layers of the waiting loads for about this many tokens (vLLM's async "
                      "KV load), so a long load does not stall the batch. 0: all in the step that schedules "
                      "the request."),
    click.option("--max-store-bytes", type=ByteSize(), default=None, metavar="SIZE",
                 help="Byte cap of the connector's segment store of finished requests' K/V (e.g. 32MiB, 4GiB); "
                      "least recently used caches are evicted, and the reuse this loses is reported "
                      "[default: 4GiB]."),
    click.option("--fault-injection", type=FaultMode(), default=None, metavar="all|FRACTION",
                 help="Fail cache loads on purpose to test the dense fallback: 'all', or a fraction of the "
                      "loads (e.g. 0.25, picked by a hash of the request)."),
]

# Adds the server options to a click command, which receives them as one `server` argument.
server_options = option_group(_OPTIONS, tuple(ServerOptions.__dataclass_fields__), ServerOptions, "server")
