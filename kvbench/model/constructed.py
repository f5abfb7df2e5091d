"""Writing a transformer circuit by hand into a zeroed LlamaForCausalLM: named residual fields,
positional and content-matching attention heads, gated MLP units, an LM head over fields.

Conventions (those of kvbench.model.circuit, which builds recall-v1's circuit the same way):
every token carries a constant `one` of size ONE that dominates the residual's RMS, and every
RMSNorm weight is set to that RMS, so normalized fields read at about their written size; binary
facts are 0 or UNIT; names' words carry even-parity codes of +-UNIT. RoPE pairs are HF/vLLM's
neox-style halves: pair p is dims (p, p + head_dim / 2) of a head, turning at rope_inv_freq[p].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvbench.model.circuit import FAST_PAIRS, positional_pair_amplitude, rope_inv_freq

ONE = 256.0
UNIT = 2.0
GATE = 8.0  # MLP gate sharpness: pre-activation +-GATE at half a fact from the threshold


@dataclass(frozen=True)
class Dim:
    """One residual dimension: field `name`, index `i`."""

    name: str
    i: int = 0


class Fields:
    """Named slices of the residual stream, allocated from dimension 0."""

    def __init__(self, hidden_size: int, fields: Sequence[tuple[str, int]]) -> None:
        self.slices: dict[str, slice] = {}
        at = 0
        for name, width in fields:
            self.slices[name] = slice(at, at + width)
            at += width
        if at > hidden_size:
            raise ValueError(f"the circuit needs {at} residual dimensions, the model has {hidden_size}")
        self.width = at

    def __getitem__(self, name: str) -> slice:
        return self.slices[name]

    def size(self, name: str) -> int:
        s = self.slices[name]
        return s.stop - s.start

    def index(self, dim: Dim) -> int:
        s = self.slices[dim.name]
        if not 0 <= dim.i < s.stop - s.start:
            raise IndexError(f"{dim.name}[{dim.i}] is outside the field")
        return s.start + dim.i

    def dims(self, name: str) -> list[Dim]:
        return [Dim(name, i) for i in range(self.size(name))]


class CircuitWriter:
    """Sets a zero-initialized LlamaForCausalLM's weights, one mechanism at a time."""

    def __init__(self, model: torch.nn.Module, fields: Fields, norm_scale: float) -> None:
        config = model.config
        self.model, self.fields = model, fields
        self.head_dim = config.head_dim
        self.half = self.head_dim // 2
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.group = config.num_attention_heads // config.num_key_value_heads
        self.inv_freq = rope_inv_freq(config)
        self.params = dict(model.named_parameters())
        self.next_unit: dict[int, int] = {}
        with torch.no_grad():
            for param in self.params.values():
                param.zero_()
            for name, param in self.params.items():
                if name.endswith("norm.weight"):
                    param.fill_(norm_scale)
            self.params["model.embed_tokens.weight"][:, fields.index(Dim("one"))] = ONE

    def _p(self, layer: int, name: str) -> torch.Tensor:
        return self.params[f"model.layers.{layer}.{name}.weight"]

    # -- embeddings and LM head ------------------------------------------------------------
    def _columns(self, where: str | Dim) -> slice | int:
        return self.fields[where] if isinstance(where, str) else self.fields.index(where)

    @torch.no_grad()
    def embed(self, token: int, where: str | Dim, values: torch.Tensor | float) -> None:
        """Token `token`'s embedding holds `values` in a field (or one dim of it)."""
        self.params["model.embed_tokens.weight"][token, self._columns(where)] = values

    @torch.no_grad()
    def lm_head(self, token: int, where: str | Dim, weights: torch.Tensor | float) -> None:
        """Token `token`'s logit reads a field (or one dim of it) with `weights`."""
        self.params["lm_head.weight"][token, self._columns(where)] = weights

    # -- attention -----------------------------------------------------------------------------
    def _kv_rows(self, kv_head: int) -> slice:
        return slice(kv_head * self.head_dim, (kv_head + 1) * self.head_dim)

    def _q_rows(self, head: int) -> slice:
        return slice(head * self.head_dim, (head + 1) * self.head_dim)

    def kv_head_of(self, head: int) -> int:
        return head // self.group

    def _position_amplitude(self) -> float:
        """Per-dim weight on `one` giving positional heads POSITION_MARGIN over their neighbours."""
        return math.sqrt(positional_pair_amplitude(self.inv_freq) / self.scale) / ONE

    @torch.no_grad()
    def positional_key(self, layer: int, kv_head: int) -> None:
        """The constant in the fast pairs' real parts: queries turned back by an offset peak there."""
        rows = self._kv_rows(kv_head)
        self._p(layer, "self_attn.k_proj")[rows.start:rows.start + FAST_PAIRS, self.fields.index(Dim("one"))] = \
            self._position_amplitude()

    @torch.no_grad()
    def positional_query(self, layer: int, head: int, offset: int) -> None:
        """A head attending to the token `offset` positions back (its key: `positional_key`)."""
        rows = self._q_rows(head)
        q = self._p(layer, "self_attn.q_proj")
        one = self.fields.index(Dim("one"))
        angles = offset * self.inv_freq[:FAST_PAIRS]
        amplitude = self._position_amplitude()
        q[rows.start:rows.start + FAST_PAIRS, one] = (amplitude * torch.cos(angles)).float()
        q[rows.start + self.half:rows.start + self.half + FAST_PAIRS, one] = (-amplitude * torch.sin(angles)).float()

    @torch.no_grad()
    def match_key(self, layer: int, kv_head: int, terms: Sequence[tuple[int, bool, Dim, float]]) -> None:
        """Content terms of a key: (RoPE pair, imaginary part?, field dim, weight). Slow pairs turn
        so little over the context that such terms match at any distance."""
        k = self._p(layer, "self_attn.k_proj")
        base = self._kv_rows(kv_head).start
        for pair, imaginary, dim, weight in terms:
            k[base + pair + (self.half if imaginary else 0), self.fields.index(dim)] = weight

    @torch.no_grad()
    def match_query(self, layer: int, head: int, terms: Sequence[tuple[int, bool, Dim, float]]) -> None:
        q = self._p(layer, "self_attn.q_proj")
        base = self._q_rows(head).start
        for pair, imaginary, dim, weight in terms:
            q[base + pair + (self.half if imaginary else 0), self.fields.index(dim)] = weight

    @torch.no_grad()
    def value(self, layer: int, kv_head: int, dims: Sequence[Dim], weight: float = 1.0, first: int = 0) -> None:
        """The kv head's value: `dims` (times `weight`) at value positions first, first + 1, ..."""
        v = self._p(layer, "self_attn.v_proj")
        base = self._kv_rows(kv_head).start + first
        for at, dim in enumerate(dims):
            v[base + at, self.fields.index(dim)] = weight

    @torch.no_grad()
    def output(self, layer: int, head: int, first: int, dims: Sequence[Dim]) -> None:
        """Head output: value positions first, first + 1, ... added to `dims`."""
        o = self._p(layer, "self_attn.o_proj")
        base = self._q_rows(head).start
        for at, dim in enumerate(dims):
            o[self.fields.index(dim), base + first + at] = 1.0

    # -- MLP -----------------------------------------------------------------------------------
    @torch.no_grad()
    def gated(self, layer: int, when: dict[Dim, float], required: int, source: Sequence[Dim] | float,
              dest: Sequence[Dim], scale: float = 1.0) -> None:
        """MLP units writing `scale * source` (field dims, or a constant) into `dest` where the
        weighted facts of `when` (each 0 or UNIT) sum to `required` units: pre-activation
        GATE * (2 * sum - (2 * required - 1)), so one fact short is -GATE (silu ~ 0)."""
        gate, up, down = (self._p(layer, f"mlp.{p}_proj") for p in ("gate", "up", "down"))
        one = self.fields.index(Dim("one"))
        for j, target in enumerate(dest):
            unit = self.next_unit.get(layer, 0)
            if unit >= gate.shape[0]:
                raise ValueError(f"layer {layer}: the circuit needs more than {gate.shape[0]} MLP units")
            self.next_unit[layer] = unit + 1
            for dim, weight in when.items():
                gate[unit, self.fields.index(dim)] = 2 * weight * GATE / UNIT
            gate[unit, one] = -(2 * required - 1) * GATE / ONE
            if isinstance(source, float | int):
                up[unit, one] = float(source) / ONE
            else:
                up[unit, self.fields.index(source[j])] = 1.0
            down[self.fields.index(target), unit] = scale / GATE

