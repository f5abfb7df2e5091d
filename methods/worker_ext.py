"""Worker extension (vLLM `--worker-extension-cls`): kvbench's calls over `/collective_rpc`."""

from __future__ import annotations

from typing import Any


def _connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvbench.methods.connector import KVBenchConnector

    connector = get_kv_transfer_group()
    if not isinstance(connector, KVBenchConnector):
        raise RuntimeError("this server does not run the kvbench connector")
    return connector


class KVBenchWorkerExtension:
    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def kvbench_attach_model(self) -> bool:
        """Hand the loaded model to the connector (the partial forward runs its modules)."""
        _connector().attach_model(self.model_runner.model)
        return True

    def kvbench_stats(self, clear: str = "false") -> dict[str, Any]:
        """Per-request method stats, segment-store and method-state bytes of this worker."""
        return _connector().stats_snapshot(clear=str(clear).lower() == "true")

    def kvbench_set_params(self, params: str) -> dict[str, Any]:
        """Swap in the method with new parameters (a JSON object), dropping its learned state."""
        import json

        return _connector().set_params(json.loads(params))

    def kvbench_reset(self, keep_method_state: str = "false") -> bool:
        """Drop saved caches and learned method state (between runs); with keep_method_state=true
        the method's online state (anchor pools, calibrations, references) survives."""
        _connector().reset_state(keep_method_state=str(keep_method_state).lower() == "true")
        return True

    def kvbench_kv_error(self, key: str, reference: str, start: str = "0", stop: str = "") -> dict[str, Any]:
        """Per-layer normalized K/V error of a saved cache against a reference (e.g. dense) one."""
        return _connector().kv_error(key, reference, int(start), int(stop) if stop else None)

    def kvbench_saved_rows(self, key: str, layer: str, start: str, stop: str) -> dict[str, Any]:
        """K and V rows [start, stop) of one layer of a saved cache (for numerical checks)."""
        return _connector().saved_rows(key, int(layer), int(start), int(stop))
