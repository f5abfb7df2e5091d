"""`mooncake_master` for a run's shared tier: started with free ports and its HTTP metadata server,
waited for, and stopped with the servers (SIGTERM, then SIGKILL; also when kvbench dies), or one a
user already runs (`--mooncake-master HOST:PORT --mooncake-metadata URL`). Its Prometheus page
gives the store's memory (`master_allocated_bytes`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvbench.methods.core.mooncake_tier import MOONCAKE_INSTALL_HINT, SharedTierSettings
from kvbench.server.errors import ServerError
from kvbench.server.lifecycle import free_port, stop_with_parent, tail

MASTER_START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class MasterAddress:
    """Where a master answers: its RPC address, its metadata URL, and its metrics page (None: unknown)."""

    master: str
    metadata: str
    metrics_url: str | None = None

    def tier_settings(self, segment_bytes: int, local_hostname: str = "127.0.0.1") -> SharedTierSettings:
        return SharedTierSettings(master=self.master, metadata=self.metadata, segment_bytes=segment_bytes,
                                  local_hostname=local_hostname)


def master_binary() -> str:
    """The `mooncake_master` beside this Python (the wheel installs it there), else on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    found = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if found is None:
        raise ServerError(f"mooncake_master not found: {MOONCAKE_INSTALL_HINT}")
    return found


class MooncakeMaster:
    """A `mooncake_master` child process (its own session), as a context manager."""

    def __init__(self, host: str = "127.0.0.1", log_path: Path | None = None) -> None:
        self.host, self.log_path = host, log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.rpc_port = self.metadata_port = self.metrics_port = 0

    @property
    def address(self) -> MasterAddress:
        return MasterAddress(f"{self.host}:{self.rpc_port}", f"http://{self.host}:{self.metadata_port}/metadata",
                             f"http://{self.host}:{self.metrics_port}/metrics")

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def command(self) -> list[str]:
        return [master_binary(), f"--rpc_port={self.rpc_port}", f"--rpc_address={self.host}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_host={self.host}",
                f"--http_metadata_server_port={self.metadata_port}", f"--metrics_port={self.metrics_port}"]

    def start(self) -> MooncakeMaster:
        self.rpc_port, self.metadata_port, self.metrics_port = free_port(self.host), free_port(self.host), free_port(self.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="kvbench-mooncake-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=stop_with_parent())
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + MASTER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if (code := self.process.poll()) is not None:
                raise ServerError(f"mooncake_master exited with code {code} during start-up (missing libibverbs1? "
                                  f"{MOONCAKE_INSTALL_HINT}); log {self.log_path}:\n{tail(self.log_path)}")  # type: ignore[arg-type]
            if allocated_bytes(self.address.metrics_url) is not None:
                return
            time.sleep(0.2)
        raise ServerError(f"mooncake_master not ready after {MASTER_START_TIMEOUT_S:.0f} s; log {self.log_path}")

    def stop(self, grace_s: float = 5.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def allocated_bytes(metrics_url: str | None) -> int | None:
    """The bytes the store holds now (`master_allocated_bytes` on the master's metrics page);
    None when the page does not answer."""
    if metrics_url is None:
        return None
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as response:
            text = response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None
    for line in text.splitlines():
        if line.startswith("master_allocated_bytes "):
            return int(float(line.split()[1]))
    return 0
