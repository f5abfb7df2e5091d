"""The local process behind a server URL, for servers a replay did not start (`kvbench serve` in
another shell, a benchmark's own instances, `vllm serve`): the process listening on the URL's
port. Their CPU then counts as the run's own rather than a neighbour's (machine_load: every run
against such servers was flagged as on a loaded machine). Their memory is not reported as a
server's: the listener may be a port-forward to another machine. Remote URLs, and listeners this
user may not see, are left out."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

import psutil

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"}


def _local_hosts() -> set[str]:
    """Names and addresses that reach this machine."""
    hosts = set(LOCAL_NAMES)
    with contextlib.suppress(OSError):
        hosts.add(socket.gethostname())
    with contextlib.suppress(psutil.Error, OSError):
        for addresses in psutil.net_if_addrs().values():
            hosts.update(address.address.split("%", 1)[0] for address in addresses)
    return hosts


def listening_pids(urls: Iterable[str]) -> dict[str, int]:
    """URL -> pid of the local process listening on its port, for the URLs that name this machine."""
    local = _local_hosts()
    ports: dict[str, int] = {}
    for url in urls:
        parts = urlsplit(url)
        with contextlib.suppress(ValueError):  # a malformed port: nothing to find
            port = parts.port or (443 if parts.scheme == "https" else 80)
            if parts.hostname in local:
                ports[url] = port
    if not ports:
        return {}
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return {}
    listening = {c.laddr.port: c.pid for c in connections if c.status == psutil.CONN_LISTEN and c.pid}
    return {url: listening[port] for url, port in ports.items() if port in listening}
