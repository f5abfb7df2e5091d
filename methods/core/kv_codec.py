"""KV codecs for a segment store: what a saved cache is kept as, and what it costs in bytes.
Pure torch, independent of vLLM.

PolyKV's scheme (ishan1410/PolyKV; read for its algorithm, written here anew):
- keys: int8 with one scale per layer tensor, scale = max|k| / 127;
- values, per head_dim vector (head_dim a power of 2): its L2 norm; the normalized vector rotated
  by the normalized fast Walsh-Hadamard transform and scaled by sqrt(d), so each coordinate is
  about N(0, 1); each coordinate replaced by the index of the nearest of the 8 Lloyd-Max
  centroids of N(0, 1) (3 bits); decoded by centroid lookup, the inverse transform and the norm.
The published code stores one index per int8 and fp32 norms; the variants a serving engine would
want are selectable: per-token or per-channel key scales, indices bit-packed 3 to a bit-triple
(8 per 3 bytes), fp16 norms. Every byte held is counted: indices, scales and norms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvbench.methods.core.codec_names import KeyScale, parse_codec_name

# Lloyd-Max quantizer of N(0, 1) with 8 levels (distortion about 0.03454 per coordinate).
LLOYD_MAX_3BIT = (-2.152, -1.344, -0.756, -0.245, 0.245, 0.756, 1.344, 2.152)
LLOYD_MAX_3BIT_MSE = 0.03454


def fwht(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform over the last dimension (a power of 2): H x, with
    H H = d I, so fwht(fwht(x)) = d x."""
    d = x.shape[-1]
    if d & (d - 1) or d == 0:
        raise ValueError(f"the Walsh-Hadamard transform needs a power-of-two length, got {d}")
    out = x.reshape(-1, d)
    h = 1
    while h < d:
        pairs = out.view(-1, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        out = torch.stack((a + b, a - b), dim=2).reshape(-1, d)
        h *= 2
    return out.reshape(x.shape)


def pack_3bit(indices: torch.Tensor) -> torch.Tensor:
    """Indices in [0, 8) [..., d], d a multiple of 8, as 3 bytes per 8 indices [..., d // 8 * 3]."""
    d = indices.shape[-1]
    if d % 8:
        raise ValueError(f"bit-packing 3-bit indices needs a multiple of 8 per vector, got {d}")
    groups = indices.to(torch.int32).reshape(*indices.shape[:-1], d // 8, 8)
    word = (groups << (3 * torch.arange(8, dtype=torch.int32))).sum(dim=-1)  # 24 bits
    packed = torch.stack(((word & 255), (word >> 8) & 255, (word >> 16) & 255), dim=-1).to(torch.uint8)
    return packed.reshape(*indices.shape[:-1], d // 8 * 3)


def unpack_3bit(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_3bit, as uint8 indices."""
    triples = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, 3)
    word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
    indices = (word.unsqueeze(-1) >> (3 * torch.arange(8, dtype=torch.int32))) & 7
    return indices.reshape(*packed.shape[:-1], -1).to(torch.uint8)


@dataclass
class Encoded:
    """A compressed [layers, n, heads, head_dim] tensor: the tensors held and how to read them."""

    tensors: dict[str, torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class KVCodec:
    """Encodes keys and values apart (keys keep their RoPE rotation: re-rotating decoded keys is
    the reader's business). Identity: the tensors as they are."""

    name = "identity"

    def encode_keys(self, k: torch.Tensor) -> Encoded:
        return Encoded({"k": k}, tuple(k.shape), k.dtype)

    def decode_keys(self, encoded: Encoded) -> torch.Tensor:
        return encoded.tensors["k"]

    def encode_values(self, v: torch.Tensor) -> Encoded:
        return Encoded({"v": v}, tuple(v.shape), v.dtype)

    def decode_values(self, encoded: Encoded) -> torch.Tensor:
        return encoded.tensors["v"]


class PolyKVCodec(KVCodec):
    """PolyKV's codec with its serving variants. `key_scale`: "tensor" (published: one per layer),
    "token" (one per layer, token and head) or "channel" (one per layer, head and channel, over
    the tokens: KIVI's choice for keys). `pack`: 3-bit indices bit-packed (else one per int8, as
    published). `norm_dtype`: fp32 (published) or fp16."""

    def __init__(self, key_scale: KeyScale = "tensor", pack: bool = True,
                 norm_dtype: torch.dtype = torch.float32) -> None:
        if key_scale not in ("tensor", "token", "channel"):
            raise ValueError(f"key_scale must be tensor, token or channel, got {key_scale!r}")
        self.key_scale, self.pack, self.norm_dtype = key_scale, pack, norm_dtype
        self.name = f"polykv-{key_scale}{'-packed' if pack else ''}{'-fp16norm' if norm_dtype == torch.float16 else ''}"
        self.centroids = torch.tensor(LLOYD_MAX_3BIT)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # (centroids, boundaries)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The centroids and the boundaries between them on `device`, copied there once."""
        if device not in self._tables:
            centroids = self.centroids.to(device)
            self._tables[device] = centroids, (centroids[1:] + centroids[:-1]) / 2
        return self._tables[device]

    # ---------------------------------------------------------------- keys: int8
    def _key_reduce_dims(self, k: torch.Tensor) -> tuple[int, ...]:
        if self.key_scale == "tensor":  # [L, n, H, d]: one per layer
            return (1, 2, 3)
        if self.key_scale == "token":
            return (3,)
        return (1,)  # channel: over the tokens

    def encode_keys(self, k: torch.Tensor) -> Encoded:
        x = k.float()
        scale = x.abs().amax(dim=self._key_reduce_dims(k), keepdim=True).clamp_min(1e-12) / 127
        q = torch.round(x / scale).clamp(-128, 127).to(torch.int8)
        return Encoded({"k_int8": q, "k_scale": scale.to(torch.float32)}, tuple(k.shape), k.dtype)

    def decode_keys(self, encoded: Encoded) -> torch.Tensor:
        return (encoded.tensors["k_int8"].float() * encoded.tensors["k_scale"]).to(encoded.dtype)

    # ---------------------------------------------------------------- values: FWHT + 3-bit Lloyd-Max
    def quantize_rotated(self, z: torch.Tensor) -> torch.Tensor:
        """Index of the nearest centroid of each coordinate (about N(0, 1))."""
        return torch.bucketize(z.contiguous(), self.tables(z.device)[1]).to(torch.uint8)

    def encode_values(self, v: torch.Tensor) -> Encoded:
        d = v.shape[-1]
        if d & (d - 1):
            raise ValueError(f"PolyKV's value codec needs a power-of-two head_dim (its Walsh-Hadamard rotation); "
                             f"this model's is {d}")
        x = v.float()
        norms = x.norm(dim=-1, keepdim=True)
        # the normalized transform (H / sqrt(d)) times sqrt(d): H itself, on the unit vector
        rotated = fwht(x / norms.clamp_min(1e-12))
        indices = self.quantize_rotated(rotated)
        stored = pack_3bit(indices) if self.pack else indices.to(torch.int8)
        return Encoded({"v_index": stored, "v_norm": norms.to(self.norm_dtype)}, tuple(v.shape), v.dtype,
                       {"packed": self.pack})

    def decode_values(self, encoded: Encoded) -> torch.Tensor:
        stored = encoded.tensors["v_index"]
        indices = unpack_3bit(stored) if encoded.meta.get("packed") else stored.to(torch.uint8)
        d = encoded.shape[-1]
        rotated = self.tables(stored.device)[0][indices.long()]
        # back: divide by sqrt(d), inverse normalized FWHT (itself), times the norm
        unit = fwht(rotated / math.sqrt(d)) / math.sqrt(d)
        return (unit * encoded.tensors["v_norm"].float()).to(encoded.dtype)


def make_codec(name: str) -> KVCodec:
    """A codec by name (kvbench.methods.core.codec_names: identity, polykv, polykv-published,
    polykv-<tensor|token|channel>[-packed][-fp16norm])."""
    parsed = parse_codec_name(name)
    if parsed.kind == "identity":
        return KVCodec()
    return PolyKVCodec(parsed.key_scale, pack=parsed.pack,
                       norm_dtype=torch.float16 if parsed.fp16_norms else torch.float32)


def params_codec(params: dict[str, object]) -> KVCodec | None:
    """The codec a method's `store_codec` parameter names (None: entries kept as saved)."""
    name = str(params.get("store_codec", "none"))
    return None if name == "none" else make_codec(name)
