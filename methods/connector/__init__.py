"""The kvbench KV connector, by role and job (after vLLM's Mooncake store connector):

- `adapter.py`: `KVBenchConnector`, the thin `KVConnectorBase_V1` vLLM loads; it builds the
  scheduler side or the worker side by role and forwards vLLM's calls to it.
- `settings.py`: `kv_connector_extra_config` (method, store cap, load budget, fault injection).
- `scheduler.py`: claims, waits on unsaved sources, pending saves (engine process).
- `worker.py`: caches, model attach, the engine step's loads and saves, worker RPCs.
- `loads.py`: running loads, synchronously or spread over engine steps.
- `materialize.py`: one load: matching, placement, narrowing, accounting.
- `saves.py`, `diagnostics.py`: into and out of the segment store.
- `specs.py`, `metadata.py`: what the sides hand each other.

Only `adapter.py` and `metadata.py` import vLLM at module level, so the rest is testable without it.
"""
