"""Turn-taking of interleaved runs (replay/rotation.py), without servers."""

from __future__ import annotations

import asyncio

import pytest

from kvbench.replay.rotation import Rotation, Step


async def _arm(rotation: Rotation, arm: str, steps: list[Step], log: list[tuple[str, Step]],
               fail_at: Step | None = None) -> None:
    await rotation.register(arm, steps)
    try:
        for step in sorted(steps):
            async with rotation.turn(arm, step):
                log.append((arm, step))
                await asyncio.sleep(0)  # others get the loop while it holds the turn
                if step == fail_at:
                    raise RuntimeError("boom")
    finally:
        await rotation.leave(arm)


def _steps(warmups: int, measured: range) -> list[Step]:
    return ([Step.of("warmup", i) for i in range(warmups)] + [Step.of("reset")]
            + [Step.of("measure", p) for p in measured])


def test_every_arm_takes_each_step_before_any_takes_the_next_in_a_rotating_order() -> None:
    rotation = Rotation(["a", "b", "c"])
    log: list[tuple[str, Step]] = []
    steps = _steps(1, range(1, 4))

    async def main() -> None:
        await asyncio.gather(*(_arm(rotation, arm, steps, log) for arm in ("c", "a", "b")))

    asyncio.run(main())
    assert [step for _, step in log] == [s for s in sorted(steps) for _ in range(3)]
    orders = [[arm for arm, _ in log[i:i + 3]] for i in range(0, len(log), 3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"], ["b", "c", "a"]]
    # each arm went first, second and third once among the three measured steps
    assert all(sorted(rotation.records[arm].order) == [0, 1, 2] for arm in "abc")


def test_only_one_arm_holds_the_turn_at_a_time() -> None:
    rotation = Rotation(["a", "b"])
    holding: list[str] = []
    overlap: list[bool] = []

    async def arm(name: str) -> None:
        steps = _steps(0, range(3))
        await rotation.register(name, steps)
        for step in steps:
            async with rotation.turn(name, step):
                overlap.append(bool(holding))
                holding.append(name)
                await asyncio.sleep(0.001)
                holding.remove(name)
        await rotation.leave(name)

    async def main() -> None:
        await asyncio.gather(arm("a"), arm("b"))

    asyncio.run(main())
    assert len(overlap) == 8 and not any(overlap)
    assert rotation.busy_s("a") > 0.002 and rotation.busy_s("b") > 0.002  # measured turns' time only


def test_an_arm_that_fails_leaves_and_the_others_finish() -> None:
    rotation = Rotation(["a", "b", "c"])
    log: list[tuple[str, Step]] = []
    steps = _steps(0, range(4))

    async def main() -> list[object]:
        return await asyncio.gather(_arm(rotation, "a", steps, log), _arm(rotation, "b", steps, log, fail_at=steps[2]),
                                    _arm(rotation, "c", steps, log), return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[1], RuntimeError) and results[0] is None and results[2] is None
    assert [s for arm, s in log if arm == "a"] == sorted(steps) == [s for arm, s in log if arm == "c"]
    assert max(s for arm, s in log if arm == "b") == steps[2]


def test_an_arm_that_never_registers_but_leaves_does_not_hold_the_others() -> None:
    rotation = Rotation(["a", "b"])
    log: list[tuple[str, Step]] = []

    async def main() -> None:
        await asyncio.gather(_arm(rotation, "a", _steps(0, range(2)), log), rotation.leave("b"))

    asyncio.run(asyncio.wait_for(main(), 5))
    assert [arm for arm, _ in log] == ["a", "a", "a"]


def test_resumed_arms_skip_the_steps_they_already_took() -> None:
    rotation = Rotation(["a", "b"])
    log: list[tuple[str, Step]] = []

    async def main() -> None:
        await asyncio.gather(_arm(rotation, "a", _steps(0, range(0, 3)), log),
                             _arm(rotation, "b", _steps(0, range(2, 3)), log))

    asyncio.run(asyncio.wait_for(main(), 5))
    assert [(arm, step.phase, step.position) for arm, step in log] == [
        ("a", "reset", 0), ("b", "reset", 0), ("a", "measure", 0), ("a", "measure", 1),
        ("b", "measure", 2), ("a", "measure", 2)]


def test_a_step_an_arm_did_not_register_is_refused() -> None:
    rotation = Rotation(["a"])

    async def main() -> None:
        await rotation.register("a", [Step.of("reset")])
        async with rotation.turn("a", Step.of("measure", 5)):
            pass

    with pytest.raises(RuntimeError, match="did not register"):
        asyncio.run(main())
    with pytest.raises(ValueError, match="distinct"):
        Rotation(["a", "a"])


def test_an_arm_is_idle_while_another_holds_the_turn() -> None:
    """An idle arm's server is not polled (a poll sets vLLM's workers spinning for a second)."""
    from kvbench.replay.rotation import ArmTurns

    rotation = Rotation(["a", "b"])
    a, b = ArmTurns(rotation, "a"), ArmTurns(rotation, "b")
    seen: list[tuple[bool, bool]] = []

    async def main() -> None:
        await a.register([Step.of("reset")])
        await b.register([Step.of("reset")])
        seen.append((a.idle(), b.idle()))
        async with a.turn("reset"):
            seen.append((a.idle(), b.idle()))
        async with b.turn("reset"):
            seen.append((a.idle(), b.idle()))

    asyncio.run(main())
    assert seen == [(False, False), (False, True), (True, False)]
