"""The segment store's codec names, parsed without torch (the CLI checks `store_codec` before a
server starts; `kv_codec.make_codec` builds the codec from the same parse)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KeyScale = Literal["tensor", "token", "channel"]
KNOWN = "identity, polykv, polykv-published, polykv-<tensor|token|channel>[-packed][-fp16norm]"


@dataclass(frozen=True)
class CodecName:
    """`identity`, or PolyKV with its key scale, index packing and norm precision."""

    kind: Literal["identity", "polykv"]
    key_scale: KeyScale = "tensor"
    pack: bool = True
    fp16_norms: bool = False


def parse_codec_name(name: str) -> CodecName:
    """identity, polykv (published keys, bit-packed indices), polykv-published (one index per
    int8, fp32 norms, exactly as published) or polykv-<tensor|token|channel>[-packed][-fp16norm];
    ValueError naming the known ones otherwise."""
    if name == "identity":
        return CodecName("identity")
    if name == "polykv":
        return CodecName("polykv")
    if name == "polykv-published":
        return CodecName("polykv", pack=False)
    parts = name.split("-")
    if parts[0] == "polykv" and len(parts) >= 2 and parts[1] in ("tensor", "token", "channel") \
            and set(parts[2:]) <= {"packed", "fp16norm"}:
        return CodecName("polykv", parts[1], "packed" in parts[2:], "fp16norm" in parts[2:])  # type: ignore[arg-type]
    raise ValueError(f"unknown KV codec {name!r}; known: {KNOWN}")
