"""A stand-in for vLLM's OpenAI completions API on loopback: streams immediately, or misbehaves
on purpose. For testing and for measuring the replayer's own overhead, never for results."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from kvbench.contracts import DeviceMemory, Plan, ServerInfo, WorkerRpc, WorkerStats, vllm_prefill_stats
from kvbench.replay.prompts import reusable_rows

StubMode = Literal["ok", "hang", "stream_error", "http_500", "truncate"]


@dataclass
class StubServer:
    mode: StubMode = "ok"
    token_delay_s: float = 0.0  # pause between streamed tokens
    # Seconds each request holds the one stand-in engine before its first token, one request at
    # a time: a server of bounded capacity (1 / prefill_s first tokens a second), so that a load
    # above it queues without bound (over-saturation).
    prefill_s: float = 0.0
    host: str = "127.0.0.1"
    port: int = 0
    max_model_len: int | None = None  # reported by /v1/models, as vLLM does
    adapters: tuple[str, ...] = ()  # LoRA adapter names /v1/models lists after the base model, as vLLM does
    # Answer kvbench's worker RPCs as a connector server would, with FullShared-like stats per
    # request (every PH row with a source counts as reused): the replayer's stats plumbing
    # without vLLM. A stand-in for tests, never a method.
    connector: bool = False
    connector_method: str = "fullshared"  # the method its RPCs say it runs
    shared_tier: dict[str, Any] | None = None  # the shared tier its info reports (ServerInfo.shared_tier)
    output_shift: int = 0  # added to every generated token: a stand-in for a method that changes outputs
    # After this many tokens the model "ends its message" with token 2 (the embedded models' end of
    # sequence): a request sent without ignore_eos stops there, as vLLM's stream carries it; one
    # sent with ignore_eos runs on past it to max_tokens, as vLLM's does. None: no end of sequence.
    eos_after: int | None = None
    metrics_text: str = "vllm:num_requests_running 0\n"
    rpc_calls: list[str] = field(default_factory=list)
    _stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    _saved: int = 0  # requests "saved" since the last reset: the stand-in store holds 1 KiB each
    _loaded: int = 0  # requests the stand-in connector "loaded" since the last reset
    # request id -> (received, first chunk written) in time.perf_counter_ns(), for overhead checks
    timings: dict[str, tuple[int, int]] = field(default_factory=dict)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    bodies: dict[str, dict[str, Any]] = field(default_factory=dict)  # request id -> body, prompt left out
    in_flight: int = 0
    max_in_flight: int = 0  # the most requests it was serving at once
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: web.AppRunner | None = None
    _engine: asyncio.Lock | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter_ns()
        body: dict[str, Any] = await request.json()
        request_id = request.headers.get("x-request-id", "")
        self.prompts[request_id] = body.get("prompt", [])
        self.bodies[request_id] = {k: v for k, v in body.items() if k != "prompt"}
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request, body, request_id, received)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request, body: dict[str, Any], request_id: str,
                      received: int) -> web.StreamResponse:
        if self.mode == "http_500":
            return web.json_response({"error": {"message": "stub failure"}}, status=500)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.prefill_s:
            self._engine = self._engine or asyncio.Lock()
            async with self._engine:
                await asyncio.sleep(self.prefill_s)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        max_tokens = int(body.get("max_tokens", 1))
        prompt = body.get("prompt", [])
        stops = self.eos_after is not None and not body.get("ignore_eos", False) and self.eos_after < max_tokens
        if stops:
            max_tokens = self.eos_after + 1  # type: ignore[operator]
        for index in range(max_tokens):
            token = (len(prompt) + index) % 1000 + 3 + self.output_shift
            if self.eos_after is not None and index == self.eos_after:
                token = 2
            choice: dict[str, Any] = {"index": 0, "text": f" t{token}", "token_ids": [token]}
            if body.get("logprobs"):  # a made-up distribution whose top token is the one sent
                top = {f"token_id:{token + k}": -0.2 - 2.0 * k for k in range(int(body["logprobs"]))}
                choice["logprobs"] = {"tokens": [f"token_id:{token}"], "token_logprobs": [-0.2], "top_logprobs": [top]}
            if index == 0:
                choice["prompt_token_ids"] = prompt
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            if index == 0:
                self.timings[request_id] = (received, time.perf_counter_ns())
                if self.mode == "stream_error":
                    await response.write(b'data: {"error": {"message": "stub in-band error", "code": 500}}\n\n')
                    return response
                if self.mode == "truncate":
                    return response
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
        claimed = self.connector and self._record_stats(body.get("kv_transfer_params") or {}, len(prompt))
        usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                 "total_tokens": len(prompt) + max_tokens,
                 # as vLLM counts it: a connector's claimed tokens are "cached" too
                 "prompt_tokens_details": {"cached_tokens": len(prompt) - 1 if claimed else 0}}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    def _record_stats(self, params: dict[str, Any], prompt_len: int) -> bool:
        """Record what the connector would report for the request; returns whether it claimed it."""
        plan = Plan.from_params(params)  # the connector's own check of the plan
        if plan is None or not plan.save_as:
            return False
        self._saved += plan.keep_cache
        if not plan.claimed(lambda plan: bool(plan.sources)):  # FullShared's rule (SharingMethod.loads_request)
            self._stats[plan.save_as] = {**vllm_prefill_stats("stub", prompt_len, 0),
                                         **({"save_s": 0.001} if plan.keep_cache else {})}
            return False
        reused = reusable_rows(plan.segments, prompt_len)  # a perfect reuse
        self._loaded += 1
        self._stats[plan.save_as] = {"method": "stub", "reused_tokens": reused, "eligible_tokens": reused,
                                     "recomputed_tokens": max(0, prompt_len - 1 - reused),
                                     "source_missing_tokens": 0, "local_tokens": 0, "claimed_tokens": prompt_len - 1}
        return True

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        method, kwargs = body.get("method"), body.get("kwargs") or {}
        self.rpc_calls.append(method)
        if not self.connector:
            return web.json_response({"error": "no worker extension"}, status=500)
        if method == WorkerRpc.INFO:
            result: Any = ServerInfo(self.connector_method, {}, True, "stub", self.shared_tier).to_dict()
        elif method == WorkerRpc.STATS:
            requests = dict(self._stats)
            if str(kwargs.get("clear", "false")).lower() == "true":
                self._stats.clear()
            result = WorkerStats(method=self.connector_method, params={}, requests=requests,
                                 store_bytes=1024 * self._saved, store_peak_bytes=1024 * self._saved,
                                 store_entries=self._saved, store_evictions=0, store_refused=0,
                                 method_state_bytes={}, model_attached=True,
                                 # as if each loaded request left 2 ms of deferred work (anchor building)
                                 extra={"deferred_s": 0.002 * self._loaded}).to_dict()
        elif method == WorkerRpc.MEMORY:  # a stand-in: fixed weights and pool, no GPU peak
            result = DeviceMemory(device="cpu", peak_allocated_bytes=None, weights_bytes=3 * 2**20,
                                  kv_pool_bytes=5 * 2**20).to_dict()
        elif method == WorkerRpc.RESET:
            self._stats.clear()
            self._saved = self._loaded = 0
            result = True
        else:
            result = True
        return web.json_response({"results": [result]})

    def _app(self) -> web.Application:
        def fixed(make: Any):
            async def handler(_: web.Request) -> web.Response:
                return make()  # a fresh response each time: one can be sent only once
            return handler

        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", fixed(lambda: web.json_response(
            {"data": [{"id": "stub-model", "max_model_len": self.max_model_len},
                      *({"id": name, "parent": "stub-model"} for name in self.adapters)]})))
        app.router.add_get("/version", fixed(lambda: web.json_response({"version": "stub"})))
        app.router.add_get("/health", fixed(lambda: web.Response(text="")))
        app.router.add_get("/metrics", fixed(lambda: web.Response(text=self.metrics_text)))
        app.router.add_post("/collective_rpc", self._collective_rpc)
        app.router.add_post("/reset_prefix_cache", fixed(lambda: web.Response(text="")))
        return app

    def start(self) -> StubServer:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._runner = web.AppRunner(self._app(), access_log=None, handler_cancellation=True,
                                         shutdown_timeout=1.0)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("stub server did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    """`python -m kvbench.replay.stub --port N [--timings-out F]`: serve until SIGTERM/SIGINT."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", default="ok")
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds between streamed tokens")
    parser.add_argument("--connector", action="store_true", help="answer kvbench's worker RPCs")
    parser.add_argument("--connector-method", default="fullshared", help="the method those RPCs say it runs")
    parser.add_argument("--child", action="store_true",
                        help="start a long-lived child process, as vLLM starts its engine (process-tree tests)")
    parser.add_argument("--timings-out", default=None, help="JSON file of per-request server timings, at exit")
    args = parser.parse_args()
    # A handler only appends: one that takes a lock (Event.set) deadlocks when it interrupts the
    # main thread inside that lock (a wait on the same Event), as a parent-death SIGTERM arriving
    # beside the replay's own stop did.
    stop_signals: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: stop_signals.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _: stop_signals.append(signum))
    if args.child:  # it ignores SIGTERM: only a kill of the whole process group ends it
        import subprocess
        import sys

        subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "time.sleep(3600)"])
    with StubServer(mode=args.mode, port=args.port, token_delay_s=args.token_delay,
                    connector=args.connector, connector_method=args.connector_method) as stub:
        print(f"stub serving on {stub.base_url}", flush=True)
        # Polled: Python runs handlers on the main thread only, and a signal the kernel hands to the
        # server thread does not interrupt the main thread's sleep.
        while not stop_signals:
            time.sleep(0.2)
    if args.timings_out:
        with open(args.timings_out, "w") as handle:
            json.dump(stub.timings, handle)


if __name__ == "__main__":
    main()
