"""`kvbench report`, `kvbench compare` and `kvbench summarize`: every figure one command away from
saved results."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvbench.cli.param_types import allow_code_execution_option


@click.command("report")
@click.argument("result_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory for report.md, CSV tables and PNG plots [default: report/ inside the first RESULT_DIR].")
@click.option("--title", default="kvbench report", show_default=True)
@click.option("--html", "as_html", is_flag=True,
              help="Also write report.html: one self-contained file (tables, plots embedded, each run's provenance).")
def report_command(result_dirs: tuple[Path, ...], out: Path | None, title: str, as_html: bool) -> None:
    """Tables and plots for runs (each RESULT_DIR is a run, or a sweep holding runs)."""
    from kvbench.analysis.runs import RunLoadError, find_runs

    out = out or result_dirs[0] / "report"  # beside the results, never into the working tree's own folders
    try:
        runs = find_runs(list(result_dirs))
    except RunLoadError as exc:
        raise click.ClickException(str(exc)) from None
    written = _write_whole(out, lambda staging: _report_files(staging, runs, title, as_html))
    click.echo((out / "report.md").read_text())
    for name in ("report.md", "report.html"):
        if name in written:
            click.echo(f"report: {out / name}", err=True)


def _report_files(staging: Path, runs: list[Any], title: str, as_html: bool) -> None:
    from kvbench.analysis.report import write_report

    path = write_report(runs, staging, title)
    if as_html:
        from kvbench.analysis.html_report import write_html_report

        write_html_report(path, runs, title)


def _write_whole(out: Path, write: Callable[[Path], None]) -> list[str]:
    """`write` into a staging folder beside `out`, then every file moved into `out` (a rename:
    no space needed); the names moved. A write that fails (a full disk) leaves nothing behind and
    is one line of error."""
    import shutil
    import tempfile

    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".kvbench-staging-", dir=out.parent))
    except OSError as exc:
        raise click.ClickException(f"cannot write into {out}: {exc.strerror or exc}") from None
    try:
        write(staging)
        names = sorted(p.name for p in staging.iterdir())
        for name in names:
            (staging / name).replace(out / name)
        return names
    except OSError as exc:
        raise click.ClickException(f"could not write the report into {out} ({exc.strerror or exc}); nothing "
                                   "was left there: free space and run it again") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _run_dirs(result_dirs: tuple[Path, ...]) -> list[Path]:
    """The runs in the given directories: each is a run, or holds runs further down (sweeps)."""
    from kvbench import run_files

    runs: list[Path] = []
    for path in result_dirs:
        runs += [path] if (path / run_files.CONFIG).exists() else sorted(p.parent for p in path.rglob(run_files.CONFIG))
    if not runs:
        raise click.ClickException(f"no kvbench runs (no {run_files.CONFIG}) in {', '.join(map(str, result_dirs))}")
    return runs


@click.command("profile")
@click.argument("result_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the table and its legend as markdown to this file.")
def profile_command(result_dirs: tuple[Path, ...], out: Path | None) -> None:
    """Where each turn's time goes inside the connector: the median of each step of its loads
    (waiting, decoding, matching, gate, correction, partial forward, attention, save) beside the
    p50 TTFT, for the turns that reuse and those that reuse nothing (each RESULT_DIR is a run, or a
    sweep holding runs). From recorded stats only: profiles any run after the fact."""
    from kvbench.analysis.profile import OUTSIDE_TURNS_LEGEND, legend, outside_turns_table, profile_table
    from kvbench.analysis.runs import RunLoadError, find_runs
    from kvbench.analysis.shared_tier import shared_tier_table

    try:
        runs = find_runs(list(result_dirs))
    except RunLoadError as exc:
        raise click.ClickException(str(exc)) from None
    table = profile_table(runs)
    if table.empty:
        raise click.ClickException("no successful requests with connector stats in these runs")
    text = table.to_markdown(index=False, floatfmt=".1f") + "\n\nSteps (median ms over the turns the connector " \
        "loaded; `claimed` counts them):\n" + legend() + "\n"
    outside = outside_turns_table(runs)
    if not outside.empty:
        text += "\nWork outside the turns, inside the engine's steps:\n\n" + \
            outside.to_markdown(index=False, floatfmt=".1f") + "\n\n" + OUTSIDE_TURNS_LEGEND + "\n"
    tier = shared_tier_table(runs)
    if not tier.empty:
        text += "\nThe shared tier (Mooncake Store between instances; a load's remote get is inside its `match` step):\n\n" + \
            tier.to_markdown(index=False, floatfmt=".2f") + "\n"
    click.echo(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        click.echo(f"profile: {out}", err=True)


@click.command("summarize")
@click.argument("result_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
def summarize_command(result_dirs: tuple[Path, ...]) -> None:
    """Recompute summary.json of runs from their recorded files (each RESULT_DIR is a run, or a
    sweep holding runs): after a metric definition changed, or for a run whose client was killed.
    The requests journal is the source of truth: requests.parquet is rebuilt from it when it is
    missing, shorter than it or unreadable (said here)."""
    from kvbench import run_files
    from kvbench.analysis.summary import write_summary

    runs = _run_dirs(result_dirs)
    for run in runs:
        try:
            summary = write_summary(run)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise click.ClickException(f"cannot summarize {run}: {type(exc).__name__}: {exc}") from None
        if summary["requests_source"] != run_files.REQUESTS:
            click.echo(f"note: {run}: read the requests from {summary['requests_source']}", err=True)
        click.echo(f"{run}: {summary['completed']} completed, {summary['failed']} failed, "
                   f"p50 TTFT {summary.get('p50_ttft_ms', float('nan')):.1f} ms")


@click.command("score")
@click.argument("result_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The task trace the runs replayed [default: the one their config names, or regenerated "
                   "from its gen-trace settings].")
@allow_code_execution_option
def score_command(result_dirs: tuple[Path, ...], trace_path: Path | None) -> None:
    """Score runs of a task trace (gen-trace --task recall, role-recall, mmlu, gsm8k, humaneval):
    each scored turn's output against its gold answer (HumanEval: its tests run, pass@1); writes
    task_scores.parquet (one row per scored turn) and task_accuracy into summary.json. Replays of a
    task trace are scored as they finish; this scores them again (or with another trace file)."""
    from kvbench.experiment.run import rescore
    from kvbench.tracegen.schema import TraceError
    from kvbench.tracegen.tasks.sandbox.code_execution import CodeExecutionRefused

    runs = _run_dirs(result_dirs)
    for run in runs:
        try:
            summary = rescore(run, trace_path)
        except (OSError, ValueError, KeyError, TraceError, CodeExecutionRefused) as exc:
            raise click.ClickException(f"cannot score {run}: {exc}") from None
        agents = "  ".join(f"{k.removeprefix('task_accuracy_')} {v:.0%}" for k, v in summary.items()
                           if k.startswith("task_accuracy_A"))
        split = ", ".join(f"{part} turns {summary[f'task_accuracy_{part}']:.1%}" for part in ("reuse", "first")
                          if f"task_accuracy_{part}" in summary)
        click.echo(f"{run}: task_accuracy {summary['task_accuracy']:.1%} over {summary['task_scored_trajectories']} "
                   f"trajectories (all turns {summary['task_accuracy_turns']:.1%}"
                   f"{'; ' + split if split else ''}; {agents})"
                   + (f"; {summary['task_unparseable']} final answers unparseable" if "task_unparseable" in summary else ""))


@click.command("quality")
@click.argument("result_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--reference", "reference_dir", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A free-running NonShared run of the same trace: what each output is compared with.")
@click.option("--floor", "floor_dir", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A --drop-shared run of the same trace: PGR's no-context floor.")
@click.option("--naive", "naive_dir", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A FullShared (naive reuse) run of the same trace: each run's PGR gain over it, with its "
                   "interval and significance.")
def quality_command(result_dirs: tuple[Path, ...], reference_dir: Path, floor_dir: Path | None,
                    naive_dir: Path | None) -> None:
    """Compare runs' outputs with a reference run's (exact match, first divergent token, token F1;
    reuse turns apart), and with --floor their PGR; writes quality.parquet and the quality keys
    into summary.json. Reference-anchored replays (replay --reference) are compared as they finish."""

    from kvbench.analysis.quality import reference_has_logprobs, write_quality
    from kvbench.analysis.summary import write_summary
    from kvbench.replay.reference import ReferenceRunError, check_comparable, comparison_caveats, read_run_config

    runs = _run_dirs(result_dirs)
    try:
        if floor_dir is not None:
            if read_run_config(floor_dir).get("prompt_mode") != "drop_shared":
                raise ReferenceRunError(f"{floor_dir} is not a --drop-shared run: it cannot be PGR's floor")
            check_comparable(floor_dir, reference_dir)
        if naive_dir is not None:
            if floor_dir is None:
                raise click.UsageError("--naive compares PGRs: it needs --floor")
            check_comparable(naive_dir, reference_dir)
        if not reference_has_logprobs(reference_dir):
            click.echo(f"warning: {reference_dir} recorded no first-token logprobs (replay it with --logprobs 20): "
                       "first-token KL is left undefined", err=True)
        for run in runs:
            check_comparable(run, reference_dir)
            for caveat in comparison_caveats(read_run_config(run), read_run_config(reference_dir)):
                click.echo(f"warning: {run}: {caveat}", err=True)
            write_quality(run, reference_dir, floor_dir, naive_dir)
            summary = write_summary(run)
            reuse = summary.get("exact_match_rate_reuse")
            line = (f"{run}: exact match {summary['exact_match_rate']:.1%} (reuse turns "
                    f"{'none' if reuse is None or math.isnan(reuse) else f'{reuse:.1%}'}), token F1 "
                    f"{summary['mean_token_f1']:.3f}, first divergence {summary['mean_first_divergence']:.1f}")
            if floor_dir is not None:
                for prefix, name in (("pgr", "PGR (task)"), ("output_pgr", "output PGR (token F1)")):
                    if prefix == "pgr" and summary.get("pgr") is None and summary.get("pgr_reason") is None:
                        continue  # no task scores: no task PGR
                    pgr = summary.get(prefix)
                    line += (f", {name} {pgr:.3f} [{summary[f'{prefix}_low']:.3f}, {summary[f'{prefix}_high']:.3f}]"
                             if pgr is not None else f", {name} undefined: {summary.get(f'{prefix}_reason')}")
                    if summary.get(f"{prefix}_gain_over_naive") is not None:
                        line += (f", gain over naive reuse {summary[f'{prefix}_gain_over_naive']:+.3f} "
                                 f"[{summary[f'{prefix}_gain_low']:+.3f}, {summary[f'{prefix}_gain_high']:+.3f}], "
                                 f"Wilcoxon p={summary[f'{prefix}_gain_p_value']:.3g}")
            click.echo(line)
    except ReferenceRunError as exc:
        raise click.ClickException(str(exc)) from None
    except (OSError, ValueError, KeyError) as exc:
        raise click.ClickException(f"cannot compare: {type(exc).__name__}: {exc}") from None


@click.command("leaderboard")
@click.argument("result_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory for the leaderboard's files [default: leaderboard/ inside the first RESULT_DIR].")
def leaderboard_command(result_dirs: tuple[Path, ...], out_dir: Path | None) -> None:
    """One row per method configuration and workload: PGR (interval, gain over naive reuse),
    recompute share, TTFT saved against NonShared, memory; markdown, CSV and JSON."""
    out_dir = out_dir or result_dirs[0] / "leaderboard"
    from kvbench.analysis.leaderboard import SORT_RULE, write_leaderboard
    from kvbench.analysis.runs import RunLoadError, find_runs

    try:
        runs = [r for r in find_runs(list(result_dirs)) if not r.is_quality_baseline]
    except RunLoadError as exc:
        raise click.ClickException(str(exc)) from None
    paths = write_leaderboard(runs, out_dir)
    click.echo(paths["markdown"].read_text())
    click.echo(f"sorted by {SORT_RULE}; wrote {', '.join(str(p) for p in paths.values())}", err=True)


@click.command("compare")
@click.argument("baseline", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("candidate", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--gate", "gates", multiple=True, metavar="METRIC=+N%|METRIC:A/B=-N%",
              help="Fail (exit 1) when the candidate is worse than the baseline by more than N%: "
                   "p50_ttft_ms=+10% (a cost may grow 10%; which way is worse: the metric catalog), "
                   "or a ratio of two methods within each side, "
                   "p50_ttft_ms:nonshared/fullshared=-10% (the speed-up may shrink 10%). Repeatable.")
@click.option("--metric", "metrics", multiple=True, help="summary.json keys to show [default: the metric "
              "catalog's compare metrics: TTFT, E2E, throughput, failures, reuse and quality; "
              "docs/results.md#metrics].")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the comparison as markdown (e.g. for a CI comment).")
@click.option("--pair", "pairs", multiple=True, metavar="BASE=CAND",
              help="Compare the baseline's method (or label) BASE with the candidate's CAND, cell by cell "
                   "(e.g. kvcmas=kvcomm). Repeatable.")
@click.option("--noise", type=click.Choice(["fail", "pass"]), default="fail", show_default=True,
              help="Whether a gate failure within the runs' noise (the p50 ratio's interval holds 1) fails.")
@click.option("--allow-loaded", is_flag=True,
              help="Gate timings of runs whose machine other processes loaded while they ran (summary "
                   "machine_loaded) as any other's, instead of exiting 3.")
def compare_command(baseline: Path, candidate: Path, gates: tuple[str, ...], metrics: tuple[str, ...],
                    markdown_path: Path | None, pairs: tuple[str, ...], noise: str, allow_loaded: bool) -> None:
    """Compare two runs (or sweeps) cell by cell; exit 1 when a gated metric regressed, 2 when a
    gate cannot be evaluated (no cell on both sides replayed the same trace with the same model,
    or a key no run has), 3 when a timing gate (latency, throughput, goodput) covers a run made on
    a machine other processes loaded (more than a tenth of its cores: its timings measured them
    too; named on stderr; --allow-loaded gates on it). Gates may be on quality too (e.g. --gate
    pgr=-0.05, --gate exact_match_rate=-0.02), and are evaluated on the cells both sides share."""
    from kvbench.analysis import metric_catalog
    from kvbench.analysis.compare import (
        Gate,
        comparable_runs,
        compare_table,
        evaluate_gates,
        failed,
        loaded_runs,
        markdown_report,
        mismatches,
        saturation_gate,
        timing_gates,
        unknown_gate_metrics,
    )
    from kvbench.analysis.runs import RunLoadError, find_runs

    try:
        parsed = [Gate.parse(g) for g in gates]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--gate") from None
    pairing = {}
    for pair in pairs:
        base_name, sep, cand_name = pair.partition("=")
        if not sep or not base_name or not cand_name:
            raise click.BadParameter(f"{pair!r}: expected BASE=CAND", param_hint="--pair")
        pairing[cand_name] = base_name
    try:
        base_runs, cand_runs = find_runs([baseline]), find_runs([candidate])
    except RunLoadError as exc:
        raise click.ClickException(str(exc)) from None
    warnings = mismatches(base_runs, cand_runs, pairing)
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    gated_base, gated_cand = base_runs, cand_runs
    if parsed:
        if problems := unknown_gate_metrics(base_runs + cand_runs, parsed):
            raise click.UsageError("--gate: " + "; ".join(problems))
        gated_base, gated_cand, reason = comparable_runs(base_runs, cand_runs, pairing)
        if reason:
            raise click.UsageError(f"--gate compares nothing: {reason}")
    table = compare_table(base_runs, cand_runs, list(metrics or metric_catalog.compared_keys()), pairing)
    results = evaluate_gates(gated_base, gated_cand, parsed, noise)  # type: ignore[arg-type]
    if parsed and (saturation := saturation_gate(gated_base, gated_cand, pairing)) is not None:
        import pandas as pd

        results = pd.concat([results, pd.DataFrame([saturation])], ignore_index=True)
    text = markdown_report(table, results, warnings)
    click.echo(text)
    if markdown_path is not None:
        markdown_path.write_text(text)
    loaded = loaded_runs(gated_base + gated_cand) if timing_gates(parsed) else []
    for run in loaded:
        click.echo(f"warning: loaded machine: {run}", err=True)
    if loaded and not allow_loaded:
        click.echo("the gates above ran on timings the machine's other processes shared: not gated (exit 3); rerun on "
                   "a quiet machine, or --allow-loaded", err=True)
        raise SystemExit(3)
    if failed(results):
        raise SystemExit(1)
