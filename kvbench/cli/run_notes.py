"""What the console says about a run beside its figures: how many trajectories its warm-ups
leave to measure, and whether other processes loaded the machine while it ran."""

from __future__ import annotations

from typing import Any

# Trajectories a run measures below which its intervals (bootstrap over trajectories) say little.
FEW_FOR_AN_INTERVAL = 5


def measured_note(trajectories: int, warmups: int) -> str | None:
    """What the warm-ups leave to measure, when they take trajectories from the trace."""
    if warmups <= 0:
        return None
    measured = trajectories - warmups
    note = f"note: the first {warmups} of the trace's {trajectories} trajectories warm up; {measured} are measured"
    if measured < FEW_FOR_AN_INTERVAL:
        note += (f". warning: {measured} measured trajectories are too few for a useful interval (intervals resample "
                 f"trajectories; give at least {FEW_FOR_AN_INTERVAL}: a longer trace or --num-trajectories)")
    return note


def load_warning(summary: dict[str, Any]) -> str | None:
    """What to say when other processes used the machine while the run ran (replay/machine_load.py)."""
    if not summary.get("machine_loaded"):
        return None
    return (f"other processes used {summary['others_cpu_share']:.0%} of the machine's cores while this ran "
            f"(at the worst tenth of it {summary.get('p90_others_cpu_share', 0):.0%}): its timings measured them too. "
            "Compare methods within one run (replay --method a,b,c) or rerun on a quiet machine.")
