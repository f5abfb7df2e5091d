"""Method parameters: one pydantic model per method, its fields' types, bounds, defaults and
descriptions in one place. `kv_connector_extra_config["params"]` is validated against it at
server start (and by the CLI before a server starts), and `kvbench methods` and docs print it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class MethodConfigError(ValueError):
    """Bad method parameters in kv_connector_extra_config (raised at server start)."""


def _problem(error: Any) -> str:
    """One validation error as `name: what is wrong (got value)`; a rule over several fields
    states its own names."""
    message = str(error["msg"]).removeprefix("Value error, ")
    if not error["loc"]:
        return message
    return f"{'.'.join(str(p) for p in error['loc'])}: {message} (got {error['input']!r})"


class MethodParams(BaseModel):
    """No parameters. Subclasses add fields; strict types: 1.0 is not an integer, "yes" not a bool."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

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
        """(name, default, description) of each parameter, for `kvbench methods` and the docs."""
        return [(name, repr(field.default), field.description or "") for name, field in cls.model_fields.items()]
