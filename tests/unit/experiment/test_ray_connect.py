"""`sweep --ray ADDRESS` where nothing listens gives up in seconds with the reason (issue 66: it
waited more than 10 minutes without a word)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.experiment.ray_sweep import unreachable


def _closed_port() -> int:
    with socket.socket() as probe:  # a port just freed: nothing listens on it
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_address_nothing_answers_at_is_named() -> None:
    port = _closed_port()
    assert f"nothing answers at 127.0.0.1:{port}" in (unreachable(f"127.0.0.1:{port}", timeout_s=2) or "")
    assert unreachable(f"ray://127.0.0.1:{port}", timeout_s=2) is not None
    assert unreachable("auto") is None  # Ray finds the cluster itself
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert unreachable(f"127.0.0.1:{listening.getsockname()[1]}", timeout_s=2) is None


def test_an_address_that_never_completes_a_connection_is_given_up_on_in_seconds() -> None:
    """A listener whose queue is full drops new connections unanswered (as a firewalled host
    does): the default wait, not the system's minutes of retries, bounds the check."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        queued = [socket.socket() for _ in range(4)]
        try:
            for client in queued:
                client.setblocking(False)
                client.connect_ex(silent.getsockname())
            time.sleep(0.2)
            started = time.monotonic()
            reason = unreachable(f"127.0.0.1:{silent.getsockname()[1]}")
            waited = time.monotonic() - started
        finally:
            for client in queued:
                client.close()
    assert reason is not None and "timed out" in reason
    assert waited < 15


def test_a_sweep_on_a_cluster_nothing_answers_at_stops_at_once(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    pytest.importorskip("ray", reason="the [ray] extra (scripts/install.sh installs it)")
    started = time.monotonic()
    result = CliRunner().invoke(main, ["sweep", "-o", str(tmp_path / "s"), "--methods", "nonshared", "--shared-tokens",
                                       "64", "--output-len", "4", "--num-trajectories", "1", "--model",
                                       str(tiny_tokenizer_dir), "--ray", f"127.0.0.1:{_closed_port()}"])
    assert result.exit_code == 1 and "nothing answers at 127.0.0.1" in result.output, result.output
    assert time.monotonic() - started < 60
