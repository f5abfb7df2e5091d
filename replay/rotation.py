"""Turn-taking for interleaved runs: several single-stream replays of one trace, each against its
own server (an arm: a method, or NonShared twice for the noise floor), take turns one trajectory
at a time, in an order that rotates with each trajectory. Slow drift on the machine (a
neighbour's load, a warming CPU) then falls on every arm alike, and ratios between arms can be
paired per trajectory; run one after another, a drift between two blocks reads as a difference
between methods.

Every step of a run that touches its server holds the turn: preparing (the reset before primed
warm-ups), each warm-up trajectory, the reset after them, each measured trajectory. All arms take
one step before any arm takes the next; within a step the arms go in the order of the step's
rotation. An arm that ends early (finished, failed, stopped) leaves, and the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

Phase = Literal["prepare", "warmup", "reset", "measure"]
PHASES: tuple[Phase, ...] = ("prepare", "warmup", "reset", "measure")


@dataclass(frozen=True, order=True)
class Step:
    """One step of a run: its phase, and for trajectories their position in the trace."""

    phase_rank: int
    position: int = 0

    @classmethod
    def of(cls, phase: Phase, position: int = 0) -> Step:
        return cls(PHASES.index(phase), position)

    @property
    def phase(self) -> Phase:
        return PHASES[self.phase_rank]


def run_steps(warmups: int, positions: Sequence[int], primed: bool) -> list[Step]:
    """The steps a run takes its turn for: preparing (primed warm-ups only), each warm-up, the
    reset after them, each trajectory left to measure (`positions`: their places in the trace)."""
    steps = [Step.of("warmup", i) for i in range(warmups)] + [Step.of("reset")]
    steps += [Step.of("measure", p) for p in positions]
    return steps + ([Step.of("prepare")] if warmups and primed else [])


@dataclass
class ArmRecord:
    """What one arm did: its steps as registered, and the seconds it held the turn by phase."""

    steps: list[Step] | None = None  # None: not registered yet
    held_s: dict[str, float] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)  # its place (0 = first) in each measured step's order


class Rotation:
    """The turns of `arms` (names, in their base order). Each arm registers the steps it will take,
    then takes each in `turn`; no turn is granted before every arm has registered or left."""

    def __init__(self, arms: Sequence[str]) -> None:
        if len(set(arms)) != len(arms) or not arms:
            raise ValueError(f"an interleaved run needs distinct arm names, got {list(arms)}")
        self.arms = list(arms)
        self.records = {arm: ArmRecord() for arm in arms}
        self._left: set[str] = set()
        self._schedule: list[tuple[Step, str]] | None = None
        self._next = 0  # index into the schedule of the turn to grant
        self.holder: str | None = None  # the arm holding the turn now
        self._changed = asyncio.Condition()

    # -- the schedule --------------------------------------------------------------------------
    def order(self, index: int) -> list[str]:
        """The arms' order in the `index`-th step: the base order rotated by `index`."""
        shift = index % len(self.arms)
        return self.arms[shift:] + self.arms[:shift]

    def _build(self) -> list[tuple[Step, str]]:
        steps = sorted({s for r in self.records.values() for s in (r.steps or [])})
        schedule = []
        for index, step in enumerate(steps):
            for arm in self.order(index):
                if step in (self.records[arm].steps or []):
                    schedule.append((step, arm))
        return schedule

    async def register(self, arm: str, steps: Sequence[Step]) -> None:
        """The steps `arm` will take (a resumed run: only those left)."""
        async with self._changed:
            self._record(arm).steps = sorted(set(steps))
            self._maybe_start()
            self._changed.notify_all()

    async def leave(self, arm: str) -> None:
        """`arm` takes no more turns (ended, failed or stopped): the others go on without it."""
        async with self._changed:
            record = self._record(arm)
            self._left.add(arm)
            if record.steps is None:
                record.steps = []
            self._maybe_start()
            self._skip_departed()
            self._changed.notify_all()

    def _record(self, arm: str) -> ArmRecord:
        if arm not in self.records:
            raise KeyError(f"no arm {arm!r} in this rotation ({', '.join(self.arms)})")
        return self.records[arm]

    def _maybe_start(self) -> None:
        if self._schedule is None and all(r.steps is not None for r in self.records.values()):
            self._schedule = self._build()
            self._skip_departed()

    def _skip_departed(self) -> None:
        while (self._schedule is not None and self._next < len(self._schedule)
               and self._schedule[self._next][1] in self._left):
            self._next += 1

    # -- taking turns --------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def turn(self, arm: str, step: Step) -> AsyncIterator[None]:
        """Hold the turn for `arm`'s `step` while the block runs (waiting for the arms before it)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._granted(arm, step))
        if step.phase == "measure":
            self.records[arm].order.append(self._place_in_step(step, arm))
        started = time.perf_counter()
        self.holder = arm
        try:
            yield
        finally:
            self.holder = None
            record = self.records[arm]
            record.held_s[step.phase] = record.held_s.get(step.phase, 0.0) + time.perf_counter() - started
            async with self._changed:
                self._next += 1
                self._skip_departed()
                self._changed.notify_all()

    def _granted(self, arm: str, step: Step) -> bool:
        if self._schedule is None or self._next >= len(self._schedule):
            if self._schedule is not None:
                raise RuntimeError(f"arm {arm!r} asked for {step} after the rotation's last turn")
            return False
        if (step, arm) not in self._schedule:
            raise RuntimeError(f"arm {arm!r} asked for {step}, which it did not register")
        return self._schedule[self._next] == (step, arm)

    def _place_in_step(self, step: Step, arm: str) -> int:
        assert self._schedule is not None
        arms = [a for s, a in self._schedule if s == step]
        return arms.index(arm)

    def busy_s(self, arm: str, phase: Phase = "measure") -> float:
        """Seconds `arm` held the turn in `phase`: a run's active time when arms take turns."""
        return self.records[arm].held_s.get(phase, 0.0)


@dataclass
class ArmTurns:
    """One arm's handle on a rotation: what a replay holds (None in a run of its own)."""

    rotation: Rotation
    arm: str

    async def register(self, steps: Sequence[Step]) -> None:
        await self.rotation.register(self.arm, steps)

    async def leave(self) -> None:
        await self.rotation.leave(self.arm)

    def turn(self, phase: Phase, position: int = 0) -> contextlib.AbstractAsyncContextManager[None]:
        return self.rotation.turn(self.arm, Step.of(phase, position))

    def busy_s(self) -> float:
        return self.rotation.busy_s(self.arm)

    def idle(self) -> bool:
        """Another arm holds the turn: this arm's server must be left alone. A poll of a vLLM
        server's workers (the method stats) sets them spinning for a second after it (vLLM's shm
        queue busy-loops after each read): polled every 2 s, two idle connector servers kept one
        of two cores busy and doubled every arm's TTFT (measured, the 8K quickstart)."""
        return self.rotation.holder not in (None, self.arm)

    def describe(self) -> dict[str, object]:
        """What a run records of its arm (run_config.json's `interleaved`)."""
        return {"arm": self.arm, "arms": list(self.rotation.arms),
                "measured_places": list(self.rotation.records[self.arm].order)}
