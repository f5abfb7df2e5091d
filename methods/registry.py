"""The method registry: `--method NAME` -> the `SharingMethod` subclass that implements it.

A method is one file in this package whose class carries `@register_method`; the class itself
holds its name, one-line summary, whether it is approximate, and its parameters (a pydantic
model). `kvbench methods`, the docs' table and every CLI check read them from here. Methods
outside kvbench register through the `kvbench.methods` entry-point group (a module to import).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from kvbench.methods.base import SharingMethod

CONNECTOR_CLASS = "KVBenchConnector"
CONNECTOR_MODULE = "kvbench.methods.connector.adapter"
WORKER_EXTENSION = "kvbench.methods.connector.worker_ext.KVBenchWorkerExtension"
ENTRY_POINT_GROUP = "kvbench.methods"
REGISTER_MARK = "@register_method"

M = TypeVar("M", bound="type[SharingMethod]")
_METHODS: dict[str, type[SharingMethod]] = {}
_discovered = False


def register_method(cls: M) -> M:
    """Class decorator: make a SharingMethod subclass available as `--method cls.name`."""
    from kvbench.methods.base import SharingMethod

    if not (isinstance(cls, type) and issubclass(cls, SharingMethod)) or cls is SharingMethod:
        raise TypeError(f"@register_method needs a SharingMethod subclass, got {cls!r}")
    if not cls.name or cls.name == SharingMethod.name or not cls.summary:
        raise TypeError(f"{cls.__qualname__}: a registered method sets `name` and a one-line `summary`")
    if (known := _METHODS.get(cls.name)) is not None and known.__qualname__ != cls.__qualname__:
        raise ValueError(f"method name {cls.name!r} is taken by {known.__module__}.{known.__qualname__}")
    _METHODS[cls.name] = cls
    return cls


def _discover() -> None:
    """Import this package's method files (those that register a class) and the entry points."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = Path(__file__).parent
    for module in pkgutil.iter_modules([str(package)]):
        path = package / f"{module.name}.py"
        if not module.ispkg and module.name != "registry" and REGISTER_MARK in path.read_text(encoding="utf-8"):
            importlib.import_module(f"kvbench.methods.{module.name}")
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry.load()


def all_methods() -> dict[str, type[SharingMethod]]:
    """Every registered method by name, sorted."""
    _discover()
    return dict(sorted(_METHODS.items()))


def method_class(name: str) -> type[SharingMethod]:
    methods = all_methods()
    if name not in methods:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(methods)}")
    return methods[name]


def validate_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """A method's parameters with defaults filled in, checked before a server is started for it
    (raises ValueError naming the bad ones)."""
    return method_class(name)(params).params


def kv_transfer_config(name: str, params: dict[str, Any] | None = None, max_store_bytes: int | None = None,
                       fault_injection: str | None = None,
                       max_load_tokens_per_step: int | None = None) -> dict[str, Any] | None:
    """The server's --kv-transfer-config for a method (None for plain vLLM)."""
    if not method_class(name).uses_connector:
        if params:
            raise ValueError(f"method {name!r} takes no parameters")
        return None
    extra: dict[str, Any] = {"method": name, "params": dict(params or {})}
    if max_store_bytes is not None:
        extra["max_store_bytes"] = max_store_bytes
    if fault_injection is not None:
        extra["fault_injection"] = fault_injection
    if max_load_tokens_per_step:
        extra["max_load_tokens_per_step"] = max_load_tokens_per_step
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # On any connector failure vLLM recomputes the request's blocks itself (dense fallback).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def methods_table() -> str:
    """A markdown table of the methods: name, approximate or exact, summary, parameters."""
    rows = ["| method | output | what it does | parameters (default) |", "|---|---|---|---|"]
    for name, cls in all_methods().items():
        params = ", ".join(f"`{p}`={default}" for p, default, _ in cls.Params.describe()) or "none"
        rows.append(f"| `{name}` | {'approximate' if cls.approximate else 'exact'} | {cls.summary} | {params} |")
    return "\n".join(rows)
