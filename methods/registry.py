"""The method registry: `--method NAME` -> its `MethodSpec` (kvbench.methods.api.spec).

The top floor of `kvbench.methods`, and torch-free: it imports the specs only. Every module of
`kvbench.methods.specs` holding a `SPEC` is a built-in method; methods outside kvbench register
through the `kvbench.methods` entry-point group (an entry point names a `MethodSpec`, or a module
holding `SPEC`), or at run time with `register`. The CLI, the replay client and the docs read
specs; the connector loads an implementation by the dotted path `kv_transfer_config` gives it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvbench.methods.api.spec import ChosenMethod, MethodSpec

if TYPE_CHECKING:
    from kvbench.methods.api.base import SharingMethod

CONNECTOR_CLASS = "KVBenchConnector"
CONNECTOR_MODULE = "kvbench.methods.connector.adapter"
WORKER_EXTENSION = "kvbench.methods.connector.worker_ext.KVBenchWorkerExtension"
ENTRY_POINT_GROUP = "kvbench.methods"
SPECS_PACKAGE = "kvbench.methods.specs"
SPECS_FOLDER = Path(__file__).parent / "specs"

_METHODS: dict[str, MethodSpec] = {}
_discovered = False


def builtin_spec_modules() -> list[str]:
    """The modules of the built-in specs, found without importing them (the layering test reads
    this list as the registry's imports)."""
    return sorted(f"{SPECS_PACKAGE}.{m.name}" for m in pkgutil.iter_modules([str(SPECS_FOLDER)]) if not m.ispkg)


def register(spec: MethodSpec) -> MethodSpec:
    """Make `spec` available as `--method spec.name` (a name is taken once)."""
    if not isinstance(spec, MethodSpec):
        raise TypeError(f"register needs a MethodSpec, got {spec!r}")
    if (known := _METHODS.get(spec.name)) is not None and known != spec:
        raise ValueError(f"method name {spec.name!r} is taken by {known.implementation}")
    _METHODS[spec.name] = spec
    return spec


def _spec_of(found: Any, where: str) -> MethodSpec:
    spec = getattr(found, "SPEC", None) if isinstance(found, ModuleType) else found
    if not isinstance(spec, MethodSpec):
        raise TypeError(f"{where} names neither a MethodSpec nor a module holding SPEC")
    return spec


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    for module in builtin_spec_modules():
        register(_spec_of(importlib.import_module(module), module))
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        register(_spec_of(entry.load(), f"entry point {entry.name} ({entry.value})"))


def all_methods() -> dict[str, MethodSpec]:
    """Every registered method's spec by name, sorted."""
    _discover()
    return dict(sorted(_METHODS.items()))


def method_spec(name: str) -> MethodSpec:
    methods = all_methods()
    if name not in methods:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(methods)}")
    return methods[name]


def resolve_method(name: str, params: dict[str, Any] | None = None) -> ChosenMethod:
    """`name` with `params` checked (ValueError naming an unknown method or a bad parameter): the
    one lookup a command makes; everything after it takes the ChosenMethod."""
    spec = method_spec(name)
    spec.parse_params(dict(params or {}))
    return ChosenMethod(spec, dict(params or {}))


def method_class(name: str) -> type[SharingMethod]:
    """The implementation of `name` (imports torch and the method: for its tests and tools that
    run methods in their own process, not for the client)."""
    from kvbench.methods.api.base import load_implementation

    return load_implementation(method_spec(name).implementation)


def validate_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """A method's parameters with defaults filled in, checked before a server is started for it
    (raises ValueError naming the bad ones)."""
    return method_spec(name).parse_params(params)


def method_keys(name: str) -> dict[str, str]:
    """The keys of kv_connector_extra_config naming a method (for tests and tools that build a
    connector's settings by hand)."""
    return ChosenMethod(method_spec(name)).connector_keys()


def kv_transfer_config(method: ChosenMethod, max_store_bytes: int | None = None, fault_injection: str | None = None,
                       max_load_tokens_per_step: int | None = None) -> dict[str, Any] | None:
    """The server's --kv-transfer-config for a method (None for plain vLLM)."""
    if not method.spec.uses_connector:
        if method.params:
            raise ValueError(f"method {method.name!r} takes no parameters")
        return None
    extra: dict[str, Any] = {**method.connector_keys(), "params": dict(method.params)}
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
    for name, spec in all_methods().items():
        params = ", ".join(f"`{p}`={default}" for p, default, _ in spec.Params.describe()) or "none"
        rows.append(f"| `{name}` | {'approximate' if spec.approximate else 'exact'} | {spec.summary} | {params} |")
    return "\n".join(rows)
