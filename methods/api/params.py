"""Method parameters: one pydantic model per method, its fields' types, bounds, defaults and
descriptions in one place. `kv_connector_extra_config["params"]` is validated against it at
server start, and by the CLI before a server starts (so this module imports no torch), and
`kvbench methods` and docs print it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvbench.methods.core.codec_names import parse_codec_name
from kvbench.methods.core.errors import MethodConfigError

__all__ = ["STORE_CODEC_HELP", "MethodConfigError", "MethodParams"]


def _problem(error: Any) -> str:
    """One validation error as `name: what is wrong (got value)`; a rule over several fields
    states its own names."""
    message = str(error["msg"]).removeprefix("Value error, ")
    if not error["loc"]:
        return message
    return f"{'.'.join(str(p) for p in error['loc'])}: {message} (got {error['input']!r})"


STORE_CODEC_HELP = ("how the segment store keeps saved caches: none, identity, polykv (PolyKV's codec, bit-packed), "
                    "polykv-published, polykv-<tensor|token|channel>[-packed][-fp16norm]")


class MethodParams(BaseModel):
    """Every method's parameters: `store_codec` (what the connector's segment store keeps); a
    subclass adds its own. Strict types: 1.0 is not an integer, "yes" not a bool."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
    store_codec: str = Field("none", description=STORE_CODEC_HELP)

    @field_validator("store_codec")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        if value != "none":
            parse_codec_name(value)  # raises ValueError naming the known codecs
        return value

    @classmethod
    def parse(cls, method: str, raw: dict[str, Any]) -> dict[str, Any]:
        """All parameters (defaults filled in) as a plain dict; MethodConfigError names every bad one."""
        known = sorted(cls.model_fields)
        if unknown := sorted(set(raw) - set(known)):
            raise MethodConfigError(f"method {method!r} has no parameter(s) {', '.join(unknown)}; "
                                    f"known: {', '.join(known) or 'none'}")
        try:
            return cls.model_validate(raw).model_dump()
        except ValidationError as exc:
            raise MethodConfigError(f"{method}: {'; '.join(_problem(e) for e in exc.errors())}") from None

    @classmethod
    def describe(cls) -> list[tuple[str, str, str]]:
        """(name, default, description) of each parameter a method sets itself, for `kvbench methods`
        and the docs (every method's `store_codec` is described once, unless a method changes its
        default)."""
        common = MethodParams.model_fields
        return [(name, repr(field.default), field.description or "") for name, field in cls.model_fields.items()
                if name not in common or field.default != common[name].default]
