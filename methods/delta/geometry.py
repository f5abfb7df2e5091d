"""Rows of a delta method's caches in the shape it matches and factorizes them in: keys turned to
canonical (segment-local) positions, [layers, n, features]."""

from __future__ import annotations

import torch

from kvbench.methods.api.base import SegmentReuse
from kvbench.methods.delta.jobs import PendingAnchor, Rows


def flat(x: torch.Tensor) -> torch.Tensor:
    """[layers, n, heads, head_dim] -> [layers, n, features], dtype kept."""
    return x.reshape(x.shape[0], x.shape[1], -1)


def canonical_source_rows(aligner: object, reuse: SegmentReuse, exact: bool) -> Rows:
    """The reused rows, keys in canonical (segment-local) positions, as [layers, n, D] in the
    source's dtype. `exact=False` rotates in that dtype (about 0.4% error): enough to match
    against anchors, whose distances are taken in bf16 anyway; an anchor's delta is the small
    difference of two caches and needs the exact rotation. `aligner`: the connector's RopeAligner."""
    src = reuse.src
    if len(src) and int(src[-1]) - int(src[0]) == len(src) - 1 and bool((src[1:] > src[:-1]).all()):
        k, v = reuse.source.k[:, int(src[0]): int(src[-1]) + 1], reuse.source.v[:, int(src[0]): int(src[-1]) + 1]
    else:
        index = src.to(reuse.source.k.device)  # plans index on the CPU; the cache may be on a GPU
        k, v = reuse.source.k.index_select(1, index), reuse.source.v.index_select(1, index)
    canonical = reuse.dst - reuse.segment.start  # segment-local position of each row
    k = aligner.rotate(k, canonical - reuse.src, exact=exact)  # type: ignore[attr-defined]
    return flat(k), flat(v)


def observed_rows(aligner: object, job: PendingAnchor) -> tuple[Rows, Rows]:
    """(source, dense target) rows of a fallback, keys in canonical positions, fp32."""
    assert job.target_k is not None and job.target_v is not None, "a fallback's rows are read before it is observed"
    source_k, source_v = (x.float() for x in canonical_source_rows(aligner, job.source, exact=True))
    # Target rows sit at dst = segment.start + canonical position: one constant shift back.
    target_k = flat(aligner.rotate(job.target_k, -job.source.segment.start)).float()  # type: ignore[attr-defined]
    return (source_k, source_v), (target_k, flat(job.target_v).float())
