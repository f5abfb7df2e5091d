"""Worker extension (vLLM `--worker-extension-cls`): kvbench's calls over `/collective_rpc`.

Each method's name is a `kvbench.contracts.WorkerRpc` value; answers are JSON-ready dicts of the
contracts' types. Arguments arrive as strings (the endpoint passes JSON kwargs through)."""

from __future__ import annotations

from typing import Any

from kvbench.contracts import WorkerRpc


def _worker() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from kvbench.methods.connector.adapter import KVBenchConnector

    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    if not isinstance(connector, KVBenchConnector):
        raise RuntimeError("this server does not run the kvbench connector (start it with `kvbench serve --method M`)")
    return connector.worker


def _flag(value: str) -> bool:
    return str(value).lower() == "true"


class KVBenchWorkerExtension:
    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def kvbench_info(self) -> dict[str, Any]:
        """What this server runs: method, parameters, kvbench and contract versions."""
        from kvbench.methods.connector.diagnostics import server_info

        return server_info(_worker()).to_dict()

    def kvbench_attach_model(self) -> bool:
        """Hand the loaded model to the connector (the partial forward runs its modules)."""
        _worker().attach_model(self.model_runner.model)
        return True

    def kvbench_stats(self, clear: str = "false") -> dict[str, Any]:
        """Per-request method stats, segment-store and method-state bytes of this worker."""
        from kvbench.methods.connector.diagnostics import worker_stats

        return worker_stats(_worker(), clear=_flag(clear)).to_dict()

    def kvbench_memory(self, reset: str = "false") -> dict[str, Any]:
        """This worker's device memory (kvbench.contracts.DeviceMemory); `reset` starts a new peak.
        Needs no connector: NonShared's plain vLLM servers answer it too."""
        from kvbench.methods.core.device_memory import device_memory, loaded_weights_bytes

        runner = self.model_runner
        caches = runner.kv_caches.values() if isinstance(runner.kv_caches, dict) else runner.kv_caches
        return device_memory(loaded_weights_bytes(runner), caches, reset=_flag(reset)).to_dict()

    def kvbench_set_params(self, params: str) -> dict[str, Any]:
        """Swap in the method with new parameters (a JSON object), dropping its learned state."""
        import json

        return _worker().set_params(json.loads(params))

    def kvbench_reset(self, keep_method_state: str = "false") -> bool:
        """Drop saved caches and learned method state (between runs); with keep_method_state=true
        the method's online state (anchor pools, calibrations, references) survives."""
        _worker().reset_state(keep_method_state=_flag(keep_method_state))
        return True

    def kvbench_kv_error(self, key: str, reference: str, start: str = "0", stop: str = "") -> dict[str, Any]:
        """Per-layer normalized K/V error of a saved cache against a reference (e.g. dense) one."""
        from kvbench.methods.connector.diagnostics import kv_error

        return kv_error(_worker().store, key, reference, int(start), int(stop) if stop else None)

    def kvbench_saved_rows(self, key: str, layer: str, start: str, stop: str) -> dict[str, Any]:
        """K and V rows [start, stop) of one layer of a saved cache (for numerical checks)."""
        from kvbench.methods.connector.diagnostics import saved_rows

        return saved_rows(_worker().store, key, int(layer), int(start), int(stop))

    def kvbench_segment_fidelity(self, request: str) -> dict[str, Any]:
        """One shared segment's dense caches in a target prompt and its source's, compared (spectra,
        reuse error, token-criteria coverage): the paper's cache-fidelity analyses."""
        from kvbench.contracts import FidelityRequest
        from kvbench.methods.connector.diagnostics import segment_fidelity

        return dict(segment_fidelity(_worker(), FidelityRequest.from_json(request)))


# Every contract RPC is a method here (a renamed one fails at import, not at a replay's first call).
_missing = [rpc.value for rpc in WorkerRpc if not callable(getattr(KVBenchWorkerExtension, rpc.value, None))]
if _missing:
    raise ImportError(f"KVBenchWorkerExtension lacks the worker RPC(s) {', '.join(_missing)}")
