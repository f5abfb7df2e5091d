"""`kvbench paper NAME`: a table or figure of the KVCMAS paper from sweep results (or its sweep
first, `--run`); `kvbench paper all --run`: every one, each sweep once, with a manifest of what
ran, on what, at which commit."""

from __future__ import annotations

import json
import platform
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from kvbench.cli.sweep import run_grid, sweep_options
from kvbench.tracegen.tasks.registry import get_task

ALL = "all"


def _paper_names() -> list[str]:
    from kvbench.analysis.paper.tables import TABLES

    return [*TABLES, ALL]


def _paper_help() -> str:
    from kvbench.analysis.paper.tables import NOT_COVERED, TABLES

    listed = "\n\n".join(f"\b\n{name}: {table.title.split(': ', 1)[1]}"
                          + (f" [--run: --protocol {table.protocol}]" if table.protocol != "free" else "")
                          for name, table in TABLES.items())
    return ("Render a table or figure of the KVCMAS paper from sweep results, the paper's values beside ours "
            "(`--run` sweeps the paper's grid first; on a CPU pass smaller --shared-tokens/--qps). `all`: every "
            "entry below, each sweep run once, with manifest.json (docs/paper.md).\n\n"
            + listed + "\n\nNot covered: " + "; ".join(NOT_COVERED.values()) + ".")


def _run_entry(name: str, folder: Path, options: dict[str, Any]) -> Path:
    """Run entry `name`'s sweep(s) in `folder`; the folder to render from."""
    from kvbench.analysis.paper import tables as paper

    entry, after_cell = paper.TABLES[name], None
    if name in paper.FIDELITY_TABLES:
        if options.get("ray_address") is not None:
            # FullShared's segments are measured in the prompts of NonShared's cell, which a Ray
            # task of its own may not have finished, nor on the same worker
            raise click.UsageError(f"paper {name} --run measures FullShared's caches against NonShared's cell of the "
                                   "same sweep on one machine; run it without --ray")
        from kvbench.experiment.fidelity import record_fidelity

        after_cell = record_fidelity()
    grid = {**entry.grid, "protocol": entry.protocol}
    if entry.output_lens and options["output_len"] is None:  # Table 10: one sweep per output length
        for output_len in entry.output_lens:
            run_grid(folder / f"sweep-out{output_len}", grid, **{**options, "output_len": output_len})
        results = folder
    else:
        results = run_grid(folder / "sweep", grid, after_cell=after_cell, **options)
    accuracy = entry.accuracy_grid
    if accuracy and all(t in options["data_files"] or get_task(t).has_default_data for t in accuracy["benchmarks"]):
        run_grid(folder / "sweep-accuracy", accuracy, **options)
        results = folder  # both sweeps
    return results


def _entry_results(name: str, folder: Path) -> Path:
    """Where `_run_entry` left entry `name`'s results in `folder`: the folder itself when it holds
    several sweeps, else its one sweep."""
    from kvbench.analysis.paper import tables as paper

    several = paper.TABLES[name].output_lens or (folder / "sweep-accuracy").is_dir()
    return folder if several else folder / "sweep"


def _render(name: str, results: Path, out: Path, paper_values: bool) -> Path:
    from kvbench.analysis.paper import tables as paper
    from kvbench.analysis.runs import RunLoadError

    try:
        return paper.render(name, results, out, paper_values)
    except (RunLoadError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None


@click.command("paper", help=_paper_help())
@click.argument("table", type=click.Choice(_paper_names()))
@click.option("--results", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Render from an existing sweep directory (with `all`: a `paper all --run` folder).")
@click.option("--run", "run_sweep", is_flag=True, help="Run the table's sweep first (at --shared-tokens/--qps...).")
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory [default: reports/<table>].")
@click.option("--paper-values/--no-paper-values", default=True, show_default=True,
              help="Show the paper's values beside ours where it has them.")
@sweep_options
def paper_command(table: str, results: Path | None, run_sweep: bool, out: Path | None, paper_values: bool,
                  **options: Any) -> None:
    started = time.monotonic()
    out = out or Path("reports") / (f"paper-{table}" if table == ALL else table)
    if run_sweep == (results is not None):
        raise click.UsageError("give exactly one of --results DIR or --run")
    if table == ALL:
        _paper_all(results or out, out, run_sweep, paper_values, options)
        return
    if run_sweep:
        results = _run_entry(table, out, options)
    assert results is not None
    path = _render(table, results, out, paper_values)
    click.echo(path.read_text())
    click.echo(f"written: {path}" + (f" (sweep and table in {time.monotonic() - started:.0f} s)" if run_sweep else ""),
               err=True)


def sweep_groups() -> dict[str, list[str]]:
    """The paper's entries by the sweep they render from (entries of one grid share it), named
    after the group's first table (else its first figure)."""
    from kvbench.analysis.paper.tables import TABLES

    by_grid: dict[str, list[str]] = {}
    for name, entry in TABLES.items():
        key = json.dumps([entry.grid, entry.protocol, entry.output_lens, entry.accuracy_grid,
                          entry.render_measured is not None], sort_keys=True, default=str)
        by_grid.setdefault(key, []).append(name)
    return {next((n for n in names if n.startswith("table")), names[0]): names for names in by_grid.values()}


def _provenance(options: dict[str, Any]) -> dict[str, Any]:
    from kvbench import __version__
    from kvbench.replay.run_config import git_sha

    device = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            device = f"cuda: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    except ImportError:
        pass
    return {"kvbench_version": __version__, "git_sha": git_sha(), "host": platform.node(),
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "device": device,
            "model": options.get("model"), "command": "kvbench paper all",
            # the options given (json-ready), from which the same sweeps run again
            "options": {key: value if isinstance(value, (int, float, str, bool, list, dict)) else str(value)
                        for key, value in options.items() if value not in (None, (), [], {}, False)}}


def _paper_all(results: Path, out: Path, run_sweep: bool, paper_values: bool, options: dict[str, Any]) -> None:
    """Every entry: with --run each group's sweep in `out/<group>`, then each entry rendered into
    `out/<entry>`; an entry whose sweep cannot run (no --data for a benchmark, a failed server)
    is recorded and the rest go on. manifest.json says what ran, where, on what and at which commit."""
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = {**_provenance(options), "started": datetime.now(UTC).isoformat(timespec="seconds"), "entries": {}}
    failed = []
    for group, names in sweep_groups().items():
        began = time.monotonic()
        folder = results / group
        try:
            if not run_sweep and not folder.is_dir():
                raise click.ClickException(f"no {folder} (run `kvbench paper all --run` first)")
            source = _run_entry(group, folder, dict(options)) if run_sweep else _entry_results(group, folder)
            error = None
        except click.ClickException as exc:
            source, error = None, exc.format_message()
        except Exception as exc:  # noqa: BLE001 (one group's failure is recorded; the others still run)
            source, error = None, f"{type(exc).__name__}: {exc}"
        for name in names:
            record: dict[str, Any] = {"sweep": str(folder.relative_to(out)) if folder.is_relative_to(out) else str(folder),
                                      "grid_of": group}
            if error is None:
                try:
                    assert source is not None
                    record.update(status="rendered", table=str(_render(name, source, out / name, paper_values)))
                except click.ClickException as exc:
                    record.update(status="failed", reason=exc.format_message())
            else:
                record.update(status="failed", reason=error)
            record["seconds"] = round(time.monotonic() - began, 1)
            manifest["entries"][name] = record
            if record["status"] != "rendered":
                failed.append(name)
            click.echo(f"{name}: {record['status']}" + (f" ({record.get('reason')})" if record.get("reason") else ""),
                       err=True)
            manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")  # kept current: a stopped run shows how far
    manifest["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    click.echo(f"written: {manifest_path} ({len(manifest['entries']) - len(failed)} of {len(manifest['entries'])} "
               "rendered)", err=True)
    if failed:
        raise click.ClickException(f"{len(failed)} entries did not render: {', '.join(failed)} (manifest.json says why; "
                                   "rerun the same command to resume their sweeps)")
