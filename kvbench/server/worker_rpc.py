"""The replayer's typed client of kvbench's worker RPCs (`kvbench.contracts.WorkerRpc`) over
vLLM's `/collective_rpc` (a dev endpoint: the server needs VLLM_SERVER_DEV_MODE=1)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

from kvbench.contracts import (
    CONTRACT_VERSION,
    ContractError,
    DeviceMemory,
    FidelityRequest,
    SegmentFidelity,
    ServerInfo,
    WorkerRpc,
    WorkerStats,
)
from kvbench.server.errors import ServerError


def collective_rpc(base_url: str, method: str, timeout_s: float = 120.0, **kwargs: str) -> list[Any]:
    """Call a worker-extension method in every worker: one answer per worker."""
    body = json.dumps({"method": str(method), "kwargs": kwargs}).encode()
    request = urllib.request.Request(f"{base_url}/collective_rpc", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.load(response).get("results", [])
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        if (refused := re.search(r"Worker failed with error '(.+?)', please check", detail, re.DOTALL)) is not None:
            # the worker ran the call and refused it (an unsupported model, say): its own words
            raise ServerError(f"{method} on {base_url}: {refused.group(1)}") from None
        raise ServerError(f"collective_rpc {method} on {base_url} failed ({exc.code}): {detail[:500]}; is the server "
                          "started with VLLM_SERVER_DEV_MODE=1 and kvbench's --worker-extension-cls?") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ServerError(f"collective_rpc {method} on {base_url} failed: {exc}") from None


class WorkerClient:
    """One server's kvbench workers. Every call answers once per worker (tensor-parallel rank)."""

    def __init__(self, base_url: str, timeout_s: float = 120.0) -> None:
        self.base_url, self.timeout_s = base_url, timeout_s

    def call(self, rpc: WorkerRpc, **kwargs: str) -> list[Any]:
        return collective_rpc(self.base_url, rpc, timeout_s=self.timeout_s, **kwargs)

    def info(self) -> list[ServerInfo]:
        """What the server runs; a server without kvbench's connector is a clear error."""
        try:
            answers = self.call(WorkerRpc.INFO)
        except ServerError as exc:
            raise ServerError(f"the server at {self.base_url} does not answer kvbench's worker RPCs (plain vLLM, "
                              f"or another kvbench version?); start it with `kvbench serve --method M`. ({exc})") from None
        if not answers:
            raise ServerError(f"the server at {self.base_url} returned no worker answers to {WorkerRpc.INFO}")
        try:
            return [ServerInfo.from_dict(answer) for answer in answers]
        except ContractError as exc:
            raise ServerError(f"the server at {self.base_url}: {exc}") from None

    def check_method(self, method: str) -> ServerInfo:
        """The server's info, refusing a server that runs another method than `method`."""
        info = self.info()[0]
        if info.method != method:
            raise ServerError(f"the server at {self.base_url} runs method {info.method!r}, not {method!r}: replay "
                              f"with --method {info.method}, or start a server with `kvbench serve --method {method}`")
        return info

    def attach_model(self) -> None:
        self.call(WorkerRpc.ATTACH_MODEL)

    def stats(self, clear: bool = False) -> list[WorkerStats]:
        answers = self.call(WorkerRpc.STATS, clear=str(clear).lower())
        try:
            return [WorkerStats.from_dict(answer) for answer in answers]
        except ContractError as exc:
            raise ServerError(f"the server at {self.base_url}: {exc}") from None

    def set_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Swap in the method with these parameters (its state dropped); returns all of them."""
        return self.call(WorkerRpc.SET_PARAMS, params=json.dumps(params))[0]

    def memory(self, reset: bool = False) -> list[DeviceMemory]:
        """Per rank: its device memory (DeviceMemory); `reset` starts a new peak after reading."""
        answers = self.call(WorkerRpc.MEMORY, reset=str(reset).lower())
        try:
            return [DeviceMemory.from_dict(answer) for answer in answers]
        except ContractError as exc:
            raise ServerError(f"the server at {self.base_url}: {exc}") from None

    def reset(self, keep_method_state: bool = False) -> None:
        self.call(WorkerRpc.RESET, keep_method_state=str(keep_method_state).lower())

    def kv_error(self, key: str, reference: str, start: int = 0, stop: int | None = None) -> list[dict[str, Any]]:
        """Per rank: per-layer squared errors and norms of a saved cache against a reference."""
        return self.call(WorkerRpc.KV_ERROR, key=key, reference=reference, start=str(start),
                         stop="" if stop is None else str(stop))

    def saved_rows(self, key: str, layer: int, start: int, stop: int) -> list[dict[str, Any]]:
        return self.call(WorkerRpc.SAVED_ROWS, key=key, layer=str(layer), start=str(start), stop=str(stop))

    def segment_fidelity(self, request: FidelityRequest) -> list[SegmentFidelity]:
        """Per rank: one shared segment's cache-fidelity measures (`FidelityRequest`)."""
        answers = self.call(WorkerRpc.SEGMENT_FIDELITY, request=request.to_json())
        for answer in answers:
            if not isinstance(answer, dict) or answer.get("contract_version") != CONTRACT_VERSION:
                raise ServerError(f"the server at {self.base_url} answered {WorkerRpc.SEGMENT_FIDELITY} in another "
                                  "contract version; install the same kvbench on both sides")
        return answers
