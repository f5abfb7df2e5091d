"""The segment store with a codec, and the polykv method's parameters (no engine)."""

from __future__ import annotations

import pytest
import torch

from kvbench.methods.api.base import MethodConfigError
from kvbench.methods.core.kv_codec import make_codec
from kvbench.methods.core.store import CompressedKV, SavedKV, SegmentStore
from kvbench.methods.registry import method_class


def _entry(n: int = 96) -> SavedKV:
    g = torch.Generator().manual_seed(n)
    return SavedKV(torch.arange(n), torch.randn(2, n, 4, 64, generator=g).bfloat16(),
                   torch.randn(2, n, 4, 64, generator=g).bfloat16())


def test_a_store_with_a_codec_keeps_compressed_bytes_and_hands_out_decompressed_caches() -> None:
    plain, packed = SegmentStore(1 << 30), SegmentStore(1 << 30, make_codec("polykv"))
    entry = _entry()
    assert plain.put("a", entry) == 0.0 and packed.put("a", entry) > 0  # compression takes time
    assert isinstance(packed.entries["a"], CompressedKV)
    assert plain.bytes == entry.nbytes and packed.bytes == packed.stored_nbytes("a")
    assert plain.bytes / packed.bytes > 2.5  # bf16 K/V against int8 keys, 3-bit values, norms, scales
    out = packed.get("a")
    assert out is not None and out.k.shape == entry.k.shape and out.k.dtype == entry.k.dtype
    relative = float((out.v.float() - entry.v.float()).norm() / entry.v.float().norm())
    assert 0 < relative < 0.25  # lossy, at about sqrt(0.0345) of the values' norm
    assert packed.get("a") is out and packed.decoded_tokens == 96  # one load's repeated reads decode once
    identity = SegmentStore(1 << 30, make_codec("identity"))
    identity.put("a", entry)
    same = identity.get("a")
    assert same is not None and torch.equal(same.k, entry.k) and torch.equal(same.v, entry.v)


def test_store_codec_is_a_parameter_of_every_method() -> None:
    assert method_class("kvcmas")({"store_codec": "polykv-channel-packed"}).params["store_codec"] == "polykv-channel-packed"
    assert method_class("polykv")({}).params["store_codec"] == "polykv"
    with pytest.raises(MethodConfigError, match="unknown KV codec 'zip'"):
        method_class("fullshared")({"store_codec": "zip"})
    assert [name for name, _, _ in method_class("kvcmas").Params.describe()] == [
        "V", "tau", "r_c", "r_delta", "gate_tokens", "prematch", "anchor_sharing", "gate",
        "apply_corrections"]  # store_codec described once, in the docs
    assert [name for name, _, _ in method_class("polykv").Params.describe()] == ["store_codec"]  # its own default
