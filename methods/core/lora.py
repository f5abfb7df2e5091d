"""The V-only LoRA adapters a server serves, as the connector's own forward applies them.

vLLM applies a request's adapter inside its batched forward (punica kernels indexed by the
batch's token layout); the connector's partial forward runs outside that forward, so it calls
the linear layers' base weights and adds the request's value term itself:

    V = W_v X + (alpha / r) (X A^T) B^T

Only V-only adapters can be applied this way (PReCache's rule, kvbench.model.adapters): an adapter
on any other module would need its term in layers the connector does not patch, so it is refused
when the server starts. The worker loads every adapter of the trace (paths from
kv_connector_extra_config["adapters"]); B keeps only this tensor-parallel rank's KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvbench.methods.core.errors import MethodConfigError


@dataclass(frozen=True)
class VLora:
    """One adapter's value term for every layer: A [L, r, hidden], B [L, kv rows on this rank, r]."""

    name: str
    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])

    def low_rank(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The adapter's LR entries X A^T [n, r] of the value-projection inputs `x` [n, hidden]."""
        return x @ self.a[layer].to(x.dtype).T

    def value_term(self, layer: int, low_rank: torch.Tensor) -> torch.Tensor:
        """(alpha / r) LR B^T [n, kv rows]: what the adapter adds to the values."""
        return (self.scaling * (low_rank.float() @ self.b[layer].float().T)).to(low_rank.dtype)


def load_v_lora(name: str, folder: str | Path, num_layers: int, kv_rows: slice, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.bfloat16) -> VLora:
    """Adapter `name` from its PEFT folder; MethodConfigError if it is not V-only or does not fit."""
    from kvbench.model.adapters import V_PROJ, read_v_lora, v_only_problems

    folder = Path(folder)
    try:
        problems = v_only_problems(folder)
        rank, scaling, layers = read_v_lora(folder, num_layers)
    except (OSError, ValueError, KeyError) as exc:
        raise MethodConfigError(f"adapter {name!r}: cannot read {folder} ({exc})") from None
    if problems:
        raise MethodConfigError(f"adapter {name!r} is not V-only, which kvbench's connector needs to compute rows "
                                f"under it: {'; '.join(problems)}")
    a_layers: list[torch.Tensor | None] = []
    b_layers: list[torch.Tensor | None] = []
    for layer, weights in enumerate(layers):
        if weights is None:  # a layer the adapter leaves alone: a zero term
            a_layers.append(None)
            b_layers.append(None)
            continue
        a, b = weights
        if a.shape[0] != rank or b.shape[1] != rank or b.shape[0] < kv_rows.stop:
            raise MethodConfigError(f"adapter {name!r}: layer {layer}'s A {tuple(a.shape)} / B {tuple(b.shape)} do not "
                                    f"fit rank {rank} and this model's value rows")
        a_layers.append(a)
        b_layers.append(b[kv_rows])
    shape = next((t for t in a_layers if t is not None), None)
    if shape is None:
        raise MethodConfigError(f"adapter {name!r}: {folder} holds no {V_PROJ} weights")
    zeros_a, zeros_b = torch.zeros_like(shape), torch.zeros(kv_rows.stop - kv_rows.start, rank, dtype=shape.dtype)
    a_all = torch.stack([zeros_a if t is None else t for t in a_layers]).to(device=device, dtype=dtype)
    b_all = torch.stack([zeros_b if t is None else t for t in b_layers]).to(device=device, dtype=dtype)
    return VLora(name, a_all, b_all, scaling)


def served_adapters(adapters: dict[str, str], attention: torch.nn.Module, num_layers: int, ranks: int,
                    rank: int) -> dict[str, VLora]:
    """The served adapters' value terms (name -> PEFT folder), B cut to this tensor-parallel rank's
    KV heads (vLLM replicates a KV head over ranks when there are fewer heads than ranks)."""
    local, head_dim = int(attention.num_kv_heads), int(attention.head_dim)
    total = int(getattr(attention, "total_num_kv_heads", local))
    first = rank * local if total >= ranks else rank * total // ranks
    rows = slice(first * head_dim, (first + local) * head_dim)
    device = next(attention.parameters()).device
    return {name: load_v_lora(name, path, num_layers, rows, device) for name, path in adapters.items()}
