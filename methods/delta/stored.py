"""How a delta method keeps a [layers, n, D] cache tensor: as is (KVComm's bases and deltas),
factorized at low rank (KVCMAS, GraphFlow), or held by a KV codec (PolyKV-coded bases); all read
back the same way, rows of a layer at a time. Pure tensor code, independent of vLLM."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.core.kv_codec import Encoded, KVCodec

# Widest feature dimension factorized with a full eigensolve. Wider ones (Llama-3.1-8B: D = 1024)
# use subspace iteration: a full fp64 eigh of 32 [1024, 1024] Gram matrices took 340 ms on an
# H200, four times per new anchor, stalling the engine for longer than an 8K prefill (250 ms).
EXACT_EIGH_MAX_FEATURES = 256
SUBSPACE_OVERSAMPLING = 16
SUBSPACE_ITERATIONS = 4


def top_right_singular_vectors(z: torch.Tensor, rank: int, exact: bool | None = None) -> torch.Tensor:
    """The top-`rank` right singular vectors of each layer of z [layers, n, D] (fp32), as [layers, rank, D].

    They are the leading eigenvectors of the Gram matrix Z^T Z [D, D]. Up to EXACT_EIGH_MAX_FEATURES
    features, a full eigensolve (fp64 for the squared condition number). Wider: subspace iteration
    on the Gram matrix (GEMMs and thin QRs; each step multiplies by the squared spectrum, so four
    steps with 16 extra directions converge for a KV cache's decaying spectrum), then the
    Rayleigh-Ritz eigensolve of the small [q, q] projection on the CPU."""
    gram = z.mT @ z
    features = gram.shape[-1]
    if exact if exact is not None else features <= EXACT_EIGH_MAX_FEATURES:
        _, eigenvectors = torch.linalg.eigh(gram.double())  # ascending eigenvalues
        return eigenvectors[..., -rank:].flip(-1).mT.to(z.dtype)
    q = min(features, rank + SUBSPACE_OVERSAMPLING)
    generator = torch.Generator(device=z.device).manual_seed(0)  # same factors for the same input
    basis = torch.randn(*gram.shape[:-1], q, generator=generator, device=z.device, dtype=z.dtype)
    for _ in range(SUBSPACE_ITERATIONS):
        basis, _ = torch.linalg.qr(gram @ basis)
    projected = (basis.mT @ gram @ basis).double().cpu()
    _, eigenvectors = torch.linalg.eigh((projected + projected.mT) / 2)
    top = eigenvectors[..., -rank:].flip(-1).to(z.device, z.dtype)
    return (basis @ top).mT


class FullRank:
    """A [layers, n, D] tensor stored as is (KVComm)."""

    def __init__(self, z: torch.Tensor, dtype: torch.dtype) -> None:
        self.z = z.to(dtype)

    @property
    def length(self) -> int:
        return self.z.shape[1]

    def rows(self, n: int, layer: int | None = None) -> torch.Tensor:
        return (self.z[:, :n] if layer is None else self.z[layer, :n]).float()

    @property
    def shape(self) -> tuple[int, int, int]:
        """[layers, n, D] of the tensor it stands for."""
        return tuple(self.z.shape)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return self.z.nbytes


class LowRank:
    """Truncated SVD per layer, Z ~ A B with A = U_r S_r [layers, n, r] and B = V_r^T [layers, r, D]."""

    def __init__(self, z: torch.Tensor, rank: int, dtype: torch.dtype, exact: bool | None = None) -> None:
        # From the eigenvectors of the Gram matrix rather than an SVD of the tall Z: the same
        # factors, 4-5x faster on CPU (14 vs 64 ms at [4, 8192, 128]); this runs for every dense
        # fallback. `exact` forces the full eigensolve (True) or subspace iteration (False).
        z = z.float()
        r = min(rank, z.shape[-2], z.shape[-1])
        b = top_right_singular_vectors(z, r, exact)  # [layers, r, D]
        self.a = (z @ b.mT).to(dtype)  # = U_r S_r
        self.b = b.to(dtype)

    @classmethod
    def from_factors(cls, a: torch.Tensor, b: torch.Tensor) -> LowRank:
        """Factors made elsewhere (A [layers, n, r], B [layers, r, D]); used by timing scripts."""
        stored = cls.__new__(cls)
        stored.a, stored.b = a, b
        return stored

    @property
    def length(self) -> int:
        return self.a.shape[1]

    def rows(self, n: int, layer: int | None = None) -> torch.Tensor:
        # In the storage dtype: bf16 GEMMs accumulate in fp32 and run on the CPU's AMX/GPU tensor cores.
        if layer is not None:
            return torch.matmul(self.a[layer, :n], self.b[layer]).float()
        return torch.matmul(self.a[:, :n], self.b).float()

    @property
    def shape(self) -> tuple[int, int, int]:
        """[layers, n, D] of the tensor it stands for."""
        return (self.a.shape[0], self.a.shape[1], self.b.shape[-1])

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes


class Coded:
    """A [layers, n, D] tensor held by a KV codec (PolyKV: int8 keys, 3-bit rotated values) and
    decoded layer by layer when read: KVComm's full-size anchor bases, which only serve matching."""

    def __init__(self, z: torch.Tensor, codec: KVCodec, head_dim: int, values: bool, dtype: torch.dtype) -> None:
        heads = z.reshape(z.shape[0], z.shape[1], -1, head_dim).to(dtype)
        self.codec, self.values = codec, values
        self.encoded = codec.encode_values(heads) if values else codec.encode_keys(heads)

    @property
    def length(self) -> int:
        return self.encoded.shape[1]

    def layer_rows(self, layer: int, n: int) -> torch.Tensor:
        """Rows [0, n) of one layer, decoded, [n, D] in the stored dtype."""
        return self._decode(layer)[:n]

    def _decode(self, layer: int) -> torch.Tensor:
        # every tensor a codec holds leads with the layer dimension (scales are kept with keepdim)
        one = Encoded({name: t[layer:layer + 1] for name, t in self.encoded.tensors.items()},
                      (1, *self.encoded.shape[1:]), self.encoded.dtype, self.encoded.meta)
        decoded = self.codec.decode_values(one) if self.values else self.codec.decode_keys(one)
        return decoded[0].reshape(self.encoded.shape[1], -1)

    def rows(self, n: int, layer: int | None = None) -> torch.Tensor:
        if layer is not None:
            return self._decode(layer)[:n].float()
        return torch.stack([self._decode(i)[:n] for i in range(self.encoded.shape[0])]).float()

    @property
    def shape(self) -> tuple[int, int, int]:
        layers, n, heads, head_dim = self.encoded.shape
        return (layers, n, heads * head_dim)

    @property
    def nbytes(self) -> int:
        return self.encoded.nbytes


Stored = FullRank | LowRank | Coded


def store(z: torch.Tensor, rank: int | None, dtype: torch.dtype) -> Stored:
    return FullRank(z, dtype) if rank is None else LowRank(z, rank, dtype)


def stored_dtype_device(s: Stored) -> tuple[torch.dtype, torch.device]:
    """The dtype rows of a stored tensor are read in, and where they live."""
    if isinstance(s, Coded):
        return s.encoded.dtype, next(iter(s.encoded.tensors.values())).device
    held = s.z if isinstance(s, FullRank) else s.b
    return held.dtype, held.device


@dataclass(frozen=True)
class BaseCodec:
    """How an anchor pool keeps full-size bases compressed: the codec and the model's head_dim
    (the value codec rotates each head's vector)."""

    codec: KVCodec
    head_dim: int
