"""The error every floor of `kvbench.methods` raises for a bad method configuration."""

from __future__ import annotations


class MethodConfigError(ValueError):
    """Bad method parameters or connector settings (kv_connector_extra_config): raised by the CLI
    before a server starts, or by the connector when the server starts."""
