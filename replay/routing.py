"""Which server a request goes to when a run replays against several (`--routing`).

- `trajectory` (default): every turn of a trajectory on one server, trajectories in turn: a
  trajectory's sources are always where its readers run.
- `agent`: a trajectory's agents spread over the servers (agent k of trajectory i on server
  (i + k) mod N), so most reuse crosses servers: the hard case.
- `round-robin`: requests in turn, whatever they read.
- `cache-aware`: the server holding the most tokens of the turn's sources (the predecessors whose
  cache holds its shared segments), the one with the fewest requests in flight breaking ties.

Where the servers share a tier (their connectors on one Mooncake master: `--instances N`, or
servers started with one), a finished source is readable on every server: a reader on another
server gets it from the store (a remote hit). Without one, a source on another server is planned
as not readable and that segment is prefilled. A source still running (a concurrent turn's
prompt) is read only on its own server either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvbench.tracegen.schema import Trajectory, Turn

ROUTING_POLICIES = ("trajectory", "agent", "round-robin", "cache-aware")


@dataclass
class Router:
    urls: list[str]
    policy: str = "trajectory"
    in_flight: dict[str, int] = field(default_factory=dict)
    _sent: int = 0

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing {self.policy!r}; choose from {', '.join(ROUTING_POLICIES)}")
        if not self.urls:
            raise ValueError("routing needs at least one server")

    def route(self, index: int, trajectory: Trajectory, turn: Turn, placed: dict[str, str]) -> str:
        """The server of `turn` of the `index`-th trajectory; `placed`: where its turns sent so far went."""
        n = len(self.urls)
        if n == 1 or self.policy == "trajectory":
            return self.urls[index % n]
        if self.policy == "agent":
            return self.urls[(index + list(trajectory.agents).index(turn.agent)) % n]
        if self.policy == "round-robin":
            self._sent += 1
            return self.urls[(self._sent - 1) % n]
        held = {url: 0 for url in self.urls}
        for segment in turn.segments:
            source = trajectory.source_of(turn, segment.ph) if segment.ph else None
            if source is not None and source in placed:
                held[placed[source]] += trajectory.segment_tokens(segment, turn)
        return min(self.urls, key=lambda url: (-held[url], self.in_flight.get(url, 0), self.urls.index(url)))

    @contextlib.contextmanager
    def sending(self, url: str) -> Iterator[None]:
        """A request to `url` in flight for the block (what cache-aware routing balances)."""
        self.in_flight[url] = self.in_flight.get(url, 0) + 1
        try:
            yield
        finally:
            self.in_flight[url] -= 1
