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
- `worker_ext.py`: the vLLM worker extension that answers kvbench's worker RPCs.
- `counters.py`, `metrics.py`: reuse totals on vLLM's own connector-stats path, and the
  `vllm:kvbench_*` Prometheus metrics they become on `/metrics`.

What the sides track for methods (they compute with kvbench.methods.core: the store, codecs,
paged layouts, partial forward, RoPE, LoRA terms):

- `compute_tracker.py`: which requests vLLM has computed (what deferred method work waits for).
- `deliveries.py`: rows a method asked for, handed over once the request's prompt is computed.
- `fits.py`: whether a method's parameters fit the model and the adapters served.

The connector loads a method from the implementation path in its settings (the spec's, handed
over by `kv_transfer_config`), never through the registry, which sits above it.

Only `adapter.py`, `metadata.py` and `metrics.py` import vLLM at module level, so the rest is testable without it.
"""
