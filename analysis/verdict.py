"""The verdict a report opens with: one line per method, what it saves on reuse turns (against
NonShared, beside the noise floor) and what it costs (answers and agreement against the
reference's, memory), read from the tables below it (kvbench.analysis.savings, reuse_cost)."""

from __future__ import annotations

import pandas as pd

from kvbench.analysis.markdown_table import md_text
from kvbench.analysis.runs import Run
from kvbench.analysis.savings import baseline_runs, comparison_key


def _cell(table: pd.DataFrame, run: str, column: str) -> str:
    if not len(table) or column not in table:
        return ""
    rows = table.loc[table["run"] == run, column]
    return str(rows.iloc[0]) if len(rows) and pd.notna(rows.iloc[0]) else ""


def _saves(savings: pd.DataFrame, cell: str) -> str:
    ratio = _cell(savings, cell, "reuse_vs_nonshared")
    if not ratio or ratio.startswith("n/a"):
        return "saves: no reuse-turn ratio (no NonShared run of its comparison, or fewer than 2 trajectories)"
    finding = _cell(savings, cell, "reuse_finding")
    floor = _cell(savings, cell, "reuse_noise_floor")
    return (f"saves: reuse turns' p50 TTFT {ratio} of NonShared's, **{finding}**"
            + (f" (noise floor: NonShared's own {floor})" if floor else ""))


def _costs(costs: pd.DataFrame, cell: str, reference_cell: str | None, aa_cell: str | None) -> str:
    parts = []
    accuracy = _cell(costs, cell, "task_accuracy_reuse")
    if accuracy:
        reference = _cell(costs, reference_cell, "task_accuracy_reuse") if reference_cell else ""
        parts.append(f"accuracy on reuse turns {accuracy}" + (f" against NonShared's {reference}" if reference else ""))
    exact = _cell(costs, cell, "exact_match_reuse")
    if exact:
        floor = _cell(costs, aa_cell, "exact_match_reuse") if aa_cell else ""
        parts.append(f"exact match with NonShared {exact}" + (f" (A/A {floor})" if floor else ""))
    kl = _cell(costs, cell, "first_token_kl_reuse")
    if kl:
        parts.append(f"first-token KL {kl}")
    return "costs: " + ("; ".join(parts) if parts else "outputs not compared with a reference nor scored "
                        "(replay --reference, kvbench quality, a task trace)")


def verdict_lines(runs: list[Run], savings: pd.DataFrame, costs: pd.DataFrame) -> list[str]:
    """One markdown bullet per method run (NonShared, its A/A arm and PGR's floor are what the
    others are read against, not verdicts)."""
    references, floors = baseline_runs(runs)
    lines = []
    for run in runs:
        if run.method == "nonshared" or run.is_floor or run.is_quality_baseline:
            continue
        reference, aa = references.get(comparison_key(run)), floors.get(comparison_key(run))
        memory = run.memory()["method_state_mib"]
        lines.append(f"- **{md_text(run.cell)}**: {_saves(savings, run.cell)}; "
                     f"{_costs(costs, run.cell, reference.cell if reference else None, aa.cell if aa else None)}; "
                     f"memory: {memory:,.0f} MiB of caches and method state")
    return lines


def provenance_line(runs: list[Run]) -> str:
    """When, with which kvbench and on what machine the runs were made (each distinct one once)."""
    from datetime import datetime

    seen: list[str] = []
    for run in runs:
        config = run.config
        machine = config.get("machine") or {}
        started = run.started
        parts = [datetime.fromtimestamp(started).strftime("%Y-%m-%d") if started else str(config.get("date", "?"))[:10],
                 f"kvbench {config.get('kvbench_version', '?')}"
                 + (f" ({str(config['git_sha'])[:7]})" if config.get("git_sha") else ""),
                 f"host {md_text(config.get('host', '?'))}"
                 + (f" ({md_text(machine.get('cpu') or 'CPU')}, {machine.get('cores')} cores, {machine.get('memory_gib')} GiB)"
                    if machine else "")]
        text = ", ".join(parts)
        if text not in seen:
            seen.append(text)
    return "Made: " + "; ".join(seen)


def load_line(runs: list[Run]) -> str:
    """What else the machine did while the runs ran (replay/machine_load.py), in one sentence."""
    shares = [share for run in runs if (share := run.others_cpu_share) is not None]
    if not shares:
        return "Load: not recorded (runs made before kvbench sampled the machine)."
    loaded = [md_text(run.cell) for run in runs if run.machine_loaded]
    low, high = min(shares), max(shares)
    span = f"{low:.0%}" if round(low, 2) == round(high, 2) else f"{low:.0%}-{high:.0%}"
    if not loaded:
        return f"Load: other processes used {span} of the machine's cores while these ran (quiet: under a tenth)."
    return (f"Load: other processes used {span} of the machine's cores while these ran; **loaded** (over a "
            f"tenth) during {', '.join(loaded)}: their timings measured the neighbours too.")
