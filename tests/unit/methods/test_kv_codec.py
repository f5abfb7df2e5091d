"""KV codecs (PolyKV's and its variants), on tensors: distortion, transforms, bytes, refusals."""

from __future__ import annotations

import pytest
import torch

from kvbench.methods.core.kv_codec import (
    LLOYD_MAX_3BIT_MSE,
    PolyKVCodec,
    fwht,
    make_codec,
    pack_3bit,
    unpack_3bit,
)


def test_fwht_is_its_own_inverse_up_to_scale() -> None:
    x = torch.randn(5, 3, 64, dtype=torch.float64)
    assert torch.allclose(fwht(fwht(x)), 64 * x)
    assert torch.allclose(fwht(x).norm(dim=-1), 8 * x.norm(dim=-1))  # H / sqrt(d) is orthonormal
    with pytest.raises(ValueError, match="power-of-two length, got 48"):
        fwht(torch.randn(2, 48))


def test_bit_packing_round_trips_three_bytes_per_eight_indices() -> None:
    indices = torch.randint(0, 8, (4, 7, 128), dtype=torch.uint8)
    packed = pack_3bit(indices)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 7, 48)
    assert torch.equal(unpack_3bit(packed), indices)


def test_value_distortion_on_gaussian_data_is_lloyd_max_s() -> None:
    """On N(0, 1) vectors the rotated coordinates are N(0, 1), so the value codec's error per
    coordinate is the 3-bit Lloyd-Max distortion (0.0345)."""
    torch.manual_seed(0)
    v = torch.randn(2, 2048, 4, 128)
    codec = PolyKVCodec()
    decoded = codec.decode_values(codec.encode_values(v))
    mse = float(((decoded - v) ** 2).mean() / (v ** 2).mean())
    assert mse == pytest.approx(LLOYD_MAX_3BIT_MSE, rel=0.05)


def test_keys_are_int8_with_the_chosen_scales() -> None:
    torch.manual_seed(1)
    k = torch.randn(3, 256, 4, 64) * torch.linspace(0.1, 10, 64)  # channels of very different ranges
    errors = {}
    for scale in ("tensor", "token", "channel"):
        codec = PolyKVCodec(key_scale=scale)
        encoded = codec.encode_keys(k)
        assert encoded.tensors["k_int8"].dtype == torch.int8
        errors[scale] = float(((codec.decode_keys(encoded) - k) ** 2).mean() / (k ** 2).mean())
    assert PolyKVCodec("tensor").encode_keys(k).tensors["k_scale"].numel() == 3  # one per layer, as published
    assert errors["channel"] < errors["tensor"] and errors["token"] < 1e-3  # per-channel suits outlier channels


@pytest.mark.parametrize("name", ["identity", "polykv", "polykv-published", "polykv-channel-packed-fp16norm"])
def test_bytes_counted_are_the_bytes_held(name: str) -> None:
    codec = make_codec(name)
    k = torch.randn(2, 100, 4, 64).bfloat16()
    v = torch.randn(2, 100, 4, 64).bfloat16()
    keys, values = codec.encode_keys(k), codec.encode_values(v)
    held = sum(t.untyped_storage().nbytes() for t in (*keys.tensors.values(), *values.tensors.values()))
    assert keys.nbytes + values.nbytes == held
    if name == "polykv":  # int8 keys, 3/8 byte per value index, one fp32 norm per vector, one key scale per layer
        elements = 2 * 100 * 4 * 64
        assert keys.nbytes + values.nbytes == elements + elements * 3 // 8 + 2 * 100 * 4 * 4 + 2 * 4
        bf16 = k.nbytes + v.nbytes
        assert bf16 / (keys.nbytes + values.nbytes) > 2.5
    if name == "identity":
        assert torch.equal(codec.decode_values(values), v) and torch.equal(codec.decode_keys(keys), k)


def test_a_non_power_of_two_head_dim_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="power-of-two head_dim .*this model's is 96"):
        PolyKVCodec().encode_values(torch.randn(1, 4, 2, 96))
    with pytest.raises(ValueError, match="unknown KV codec 'zip'"):
        make_codec("zip")
