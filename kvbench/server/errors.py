"""Errors the replay layer raises about servers (shared by the server lifecycle and the RPC client)."""

from __future__ import annotations


class ServerError(RuntimeError):
    """The server could not be started, died, or is unreachable; the message says why."""
