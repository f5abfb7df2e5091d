"""What a method is, without its implementation: `MethodSpec`. The replay client, the CLI and the
docs read a method's flags and parameters from its spec, importing neither torch nor vLLM; the
worker loads the implementation by its dotted path (kvbench.methods.api.base.load_implementation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbench.methods.api.params import MethodParams


@dataclass(frozen=True)
class MethodSpec:
    """A method's declaration: `--method name`, its one-line summary, the `SharingMethod` subclass
    that implements it (`"module:Class"`), its parameters, and what the client must know of it."""

    name: str
    summary: str  # one line for `kvbench methods` and the README table
    implementation: str  # "package.module:Class", imported only where the method runs (vLLM's workers)
    Params: type[MethodParams] = MethodParams
    # Placed K/V differ from a dense prefill: such requests get a cache_salt so that vLLM's prefix
    # cache never serves their blocks to an exact request.
    approximate: bool = True
    # Runs inside vLLM through kvbench's connector (False: plain vLLM, NonShared only).
    uses_connector: bool = True
    # Works only on agents that are LoRA adapters (the server must serve some): PReCache's methods.
    needs_adapters: bool = False
    # The parameter `kvbench calibrate` bisects for a target reuse ratio (None: nothing to
    # calibrate), the range it searches, and whether rho rises with it.
    threshold_name: str | None = None
    threshold_range: tuple[float, float] = (0.0, 1.0)
    rho_rises_with_threshold: bool = True
    # `kvbench calibrate` profiles its recomputed layer group instead (DroidSpeak).
    layer_profiled: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.summary:
            raise TypeError(f"a method spec sets `name` and a one-line `summary`, got {self!r}")
        if self.implementation.count(":") != 1:
            raise TypeError(f"{self.name}: implementation must be 'package.module:Class', got {self.implementation!r}")
        if self.threshold_name is not None and self.threshold_name not in self.Params.model_fields:
            raise TypeError(f"{self.name}: threshold {self.threshold_name!r} is not one of its parameters")

    def parse_params(self, raw: dict[str, Any]) -> dict[str, Any]:
        """All parameters with defaults filled in; MethodConfigError names every bad one."""
        return self.Params.parse(self.name, raw)


@dataclass(frozen=True)
class ChosenMethod:
    """A method looked up once, at the edge (the CLI, a sweep's configuration), with its
    parameters checked: what the replay, the server's configuration and the connector's transfer
    configuration take, so none of them looks the name up again."""

    spec: MethodSpec
    params: dict[str, Any] = field(default_factory=dict)  # as given; the worker fills in the defaults

    @property
    def name(self) -> str:
        return self.spec.name

    def with_params(self, params: dict[str, Any]) -> ChosenMethod:
        """The same method with other parameters (a calibrated threshold), checked."""
        self.spec.parse_params(dict(params))
        return ChosenMethod(self.spec, dict(params))

    def connector_keys(self) -> dict[str, str]:
        """The keys of kv_connector_extra_config naming it: its name and its implementation."""
        return {"method": self.name, "implementation": self.spec.implementation}
