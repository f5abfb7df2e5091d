"""Whether a method's parameters fit the model it is bound to: refused at attach (or when the
parameters change), with a message naming what to change, never midway through a load."""

from __future__ import annotations

from kvbench.methods.api.base import MethodConfigError, SharingMethod


def check_method_fits(method: SharingMethod, layers: int, adapters_served: bool) -> None:
    """Selective recomputation narrows after its check layer, so that layer needs one after it;
    a recomputed layer group must lie inside the model."""
    if method.needs_adapters and not adapters_served:
        raise MethodConfigError(f"{method.name} rebuilds values per LoRA adapter, and the server serves none "
                                "(serve the trace's adapters: kvbench replay does it for a trace with adapters)")
    check, checks = method.check_layer(), method.check_layers()
    if check is not None and not 0 <= check < layers - 1:
        raise MethodConfigError(f"{method.name}: check_layer must be in [0, {layers - 2}] for this "
                                f"{layers}-layer model, got {check}")
    if checks and checks[-1] >= layers - 1:
        raise MethodConfigError(f"{method.name}: its last filtering layer ({checks[-1]}) must have a layer after "
                                f"it in this {layers}-layer model: fewer filtering steps")
    group = method.recompute_layers()
    if group is not None and not 0 <= group[0] < group[1] <= layers:
        raise MethodConfigError(f"{method.name}: recomputed layers [{group[0]}, {group[1]}) must be a non-empty "
                                f"range inside this {layers}-layer model's [0, {layers})")
    if group is not None and len(checks) > 1:
        raise MethodConfigError(f"{method.name}: gradual filtering (several check layers) needs every row "
                                "computed up to the first, not a recomputed layer group")
    if group is not None and check is not None and not group[0] <= check < group[1] - 1:
        raise MethodConfigError(f"{method.name}: the check layer ({check}) must lie in the recomputed layers "
                                f"[{group[0]}, {group[1]}) with a layer of them after it")
