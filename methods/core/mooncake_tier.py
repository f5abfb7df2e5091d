"""The shared tier's client: Mooncake Store (`mooncake.store.MooncakeDistributedStore`), which
vLLM instances on one machine or many reach through one `mooncake_master`. kvbench writes no
store or transfer of its own: values are opaque bytes here (kvbench.methods.core.entry_bytes
makes them), keys name what they hold (`shared_key`), and every figure of a run is counted.

torch-free: the client side builds `SharedTierSettings`; the connector's workers put and get, and
its scheduler side asks only whether keys exist (a client that lends the store no memory).
"""

from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MOONCAKE_INSTALL_HINT = ("the shared tier needs Mooncake's client: pip install 'kvbench[mooncake]' "
                         "(mooncake-transfer-engine-non-cuda; on GPU machines mooncake-transfer-engine) and, on "
                         "Debian or Ubuntu, apt-get install libibverbs1 (its binaries link it, even over TCP)")


class SharedTierError(RuntimeError):
    """The shared tier cannot be set up (its client missing, its master unreachable)."""


@dataclass(frozen=True)
class SharedTierSettings:
    """Where the shared tier is and what each instance lends it (kv_connector_extra_config
    "shared_tier")."""

    master: str  # mooncake_master's RPC address, HOST:PORT
    metadata: str  # its HTTP metadata server, http://HOST:PORT/metadata
    protocol: str = "tcp"  # "rdma" where the nodes have it
    device: str = ""  # RDMA device names (empty: none, or Mooncake's choice)
    segment_bytes: int = 1 << 30  # memory each worker lends the store (allocated lazily)
    buffer_bytes: int = 256 << 20  # each client's transfer buffer; a value larger than it is refused
    local_hostname: str = "127.0.0.1"  # how the other instances reach this one's segment

    @classmethod
    def from_dict(cls, raw: Any) -> SharedTierSettings:
        if not isinstance(raw, dict) or not raw.get("master") or not raw.get("metadata"):
            raise ValueError(f"shared_tier needs 'master' (HOST:PORT) and 'metadata' (its URL), got {raw!r}")
        known = {f for f in cls.__dataclass_fields__}
        if unknown := set(raw) - known:
            raise ValueError(f"unknown shared_tier key(s): {', '.join(sorted(unknown))}")
        settings = cls(**raw)
        if settings.segment_bytes < 0 or settings.buffer_bytes <= 0:
            raise ValueError(f"shared_tier: segment_bytes must be >= 0 and buffer_bytes > 0, got {raw!r}")
        return settings

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@functools.lru_cache(maxsize=16)  # asked per source lookup, and per engine step for a turn held back
def model_tag(model: str) -> str:
    """A model's part of a key: its last path part and a hash of the whole name, so two models
    (or two folders of one name) never share an entry."""
    return f"{model.rstrip('/').rsplit('/', 1)[-1]}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"


def shared_key(model: str, save_key: str, adapter: str | None, rank: int = 0, ranks: int = 1) -> str:
    """Where a saved cache lives in the shared tier: the model, the save key (run, trajectory and
    source turn), the adapter that wrote it, and the tensor-parallel rank whose heads it holds."""
    return f"kvbench/{model_tag(model)}/{save_key}/{adapter or 'base'}/tp{rank}of{ranks}"


@dataclass
class TierCounts:
    """What a tier did since the last reset (lookups by key: a load reading several segments of one
    source looks it up once per segment; a remote hit is kept locally, so later lookups hit there)."""

    local_hits: int = 0
    remote_hits: int = 0
    misses: int = 0
    rejected: int = 0  # remote entries refused (corrupt, another model or codec): counted as misses too
    remote_bytes: int = 0
    get_s: list[float] = field(default_factory=list)  # each remote get that found its key
    puts: int = 0
    put_bytes: int = 0
    put_s: float = 0.0
    put_failures: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class MooncakeTier:
    """One Mooncake Store client. `segment_bytes=0` (the scheduler side): it lends no memory and
    only asks whether keys exist."""

    def __init__(self, settings: SharedTierSettings, lend_memory: bool = True) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise SharedTierError(f"{MOONCAKE_INSTALL_HINT} ({exc})") from None
        self.settings = settings
        self.store = MooncakeDistributedStore()
        code = self.store.setup(settings.local_hostname, settings.metadata,
                                settings.segment_bytes if lend_memory else 0, settings.buffer_bytes,
                                settings.protocol, settings.device, settings.master)
        if code != 0:
            raise SharedTierError(f"Mooncake Store setup failed (code {code}): is mooncake_master running at "
                                  f"{settings.master} with its metadata server at {settings.metadata}?")
        self.counts = TierCounts()
        self._put_keys: set[str] = set()

    def put(self, key: str, value: bytes) -> bool:
        """Store `value` under `key`, replacing an earlier value (a prompt saved at its prefill,
        then the whole request); False when the store refused it (full, too large)."""
        started = time.perf_counter()
        code = self.store.upsert(key, value)
        self.counts.put_s += time.perf_counter() - started
        if code != 0:
            self.counts.put_failures += 1
            return False
        self.counts.puts += 1
        self.counts.put_bytes += len(value)
        self._put_keys.add(key)
        return True

    def get(self, key: str) -> bytes | None:
        started = time.perf_counter()
        value = self.store.get(key)
        if not value:
            return None
        self.counts.get_s.append(time.perf_counter() - started)
        self.counts.remote_bytes += len(value)
        return value

    def exists(self, keys: list[str]) -> dict[str, bool]:
        """Whether each key is in the store now (a failed query reads as absent)."""
        return {key: found == 1 for key, found in zip(keys, self.store.batch_is_exist(keys), strict=True)}

    def clear(self) -> None:
        """Remove what this client put (a run's entries: the next run starts cold) and zero the counts."""
        if self._put_keys:
            self.store.batch_remove(sorted(self._put_keys), True)
        self._put_keys.clear()
        self.counts = TierCounts()

    def close(self) -> None:
        self.store.close()
