"""`kvbench replay` composed: the trace (read, or generated in memory), the run's configuration,
its result folder (locked before a server starts), its server, the replay and its summary. The
CLI only parses flags into these calls and prints what they return."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from kvbench import run_files
from kvbench.experiment.run import replay_and_summarize
from kvbench.experiment.servers import replay_server
from kvbench.methods.api.spec import ChosenMethod
from kvbench.replay.run_config import ReplayConfig
from kvbench.server.config import ServerConfig
from kvbench.server.instances import InstancePlan
from kvbench.tracegen.schema import Trace
from kvbench.tracegen.tokenizer import TraceTokenizer


class ReplayInputError(ValueError):
    """A replay's inputs do not fit together; `option` names the flag to change (None: several)."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


def load_trace(trace_path: Path | None, model: str | None, num_trajectories: int | None, num_warmups: int,
               shared_tokens: int, output_len: int, seed: int) -> tuple[Trace, TraceTokenizer, str]:
    """The trace (`trace_path` cut to its first warm-ups + `num_trajectories`, checked against its
    tokenizer; None: a four-agent trace generated in memory), its tokenizer and the model to
    serve. Raises TraceError or ValueError naming the problem."""
    from kvbench.model.resolve import resolve_model
    from kvbench.tracegen.generate import TraceSpec, generate_trace
    from kvbench.tracegen.tokenizer import load_tokenizer
    from kvbench.tracegen.trace_files import read_trace

    if trace_path is None:
        tokenizer = load_tokenizer(model)
        spec = TraceSpec(num_trajectories=(num_trajectories or 10) + num_warmups, shared_tokens=shared_tokens,
                         output_len=output_len, seed=seed)
        header, trajectories = generate_trace(spec, tokenizer)
        trace = Trace(header=header, trajectories=trajectories)
    else:
        from kvbench.tracegen.validate import checked_tokenizer

        trace = read_trace(trace_path)
        if num_trajectories is not None:
            kept = num_trajectories + num_warmups
            trace = Trace(header=trace.header, trajectories=trace.trajectories[:kept],
                          line_numbers=trace.line_numbers[:kept])
        tokenizer = checked_tokenizer(trace, model, trace_path)  # replay only what validates
    return trace, tokenizer, resolve_model(model if model is not None else trace.header.tokenizer)


def replay_config(trace: Trace, tokenizer: TraceTokenizer, model: str, method: ChosenMethod, *,
                  base_urls: list[str], result_dir: Path | None, label: str | None, reference_dir: Path | None,
                  trace_path: Path | None, max_load_tokens_per_step: int | None, qps: float, num_warmups: int,
                  use_trace_timestamps: bool, drop_shared: bool, logprobs: int | None,
                  protocol: str | None = None, **settings: Any) -> ReplayConfig:
    """The run's configuration from the command's settings (the rest are ReplayConfig.build's), with
    what follows from them: the reference run read, the floor's label, the default result folder,
    logprobs recorded against a reference (None: 20 with one, else 0). `protocol` (replay/protocol.py;
    None: paper-decode with a reference, else free) must agree with the reference given."""
    from kvbench.tracegen.schema import MAX_ARRIVAL_S

    if qps > 0 and not use_trace_timestamps and len(trace.trajectories) / qps > MAX_ARRIVAL_S:
        raise ReplayInputError(f"{qps:g} spreads {len(trace.trajectories)} trajectories over about "
                               f"{len(trace.trajectories) / qps:g} s, past the {MAX_ARRIVAL_S:g} s a trace allows "
                               "(0 runs them one after another)", "--qps")
    if method.spec.needs_adapters and not trace.header.adapters:
        raise ReplayInputError(f"--method {method.name} rebuilds each agent's values from its LoRA adapter, and this "
                               "trace's agents use none (gen-trace --adapter ROLE=PATH; kvbench model adapters)")
    from kvbench.replay.protocol import protocol as find_protocol

    chosen = find_protocol(protocol or ("paper-decode" if reference_dir is not None else "free"))
    if chosen.anchored and reference_dir is None:
        raise ReplayInputError(f"--protocol {chosen.name}: every prompt carries a reference run's outputs; give "
                               "--reference RUN_DIR (a free NonShared replay of this trace: kvbench replay --method "
                               "nonshared)", "--reference")
    if not chosen.anchored and reference_dir is not None:
        raise ReplayInputError("--protocol free: each turn reads this run's own outputs; --reference anchors them to "
                               "the reference's (--protocol paper or paper-decode)", "--protocol")
    reference = None
    if reference_dir is not None:
        from kvbench.replay.reference import ReferenceRunError, load_reference

        if drop_shared:
            raise ReplayInputError("--drop-shared leaves no upstream output to anchor: give --reference or "
                                   "--drop-shared, not both")
        try:
            reference = load_reference(reference_dir, trace.trajectories[num_warmups:], model)
        except ReferenceRunError as exc:
            raise ReplayInputError(str(exc), "--reference") from None
    if drop_shared and label is None:
        label = run_files.FLOOR_LABEL  # PGR's floor is its own kind of run, never another NonShared row
    if result_dir is None:
        result_dir = Path("results") / f"{label or method.name}-{qps:g}qps-{datetime.now():%Y%m%d-%H%M%S}"
    return ReplayConfig.build(
        trace=trace, tokenizer=tokenizer, method=method, base_urls=[u.rstrip("/") for u in base_urls],
        result_dir=result_dir, label=label, reference=reference, qps=qps,
        num_warmups=num_warmups, use_trace_timestamps=use_trace_timestamps, drop_shared=drop_shared,
        first_token_only=chosen.first_token_only,
        logprobs=logprobs if logprobs is not None else (20 if reference is not None else 0),
        extra_config={"model": model, "method_params": method.params,
                      "trace_path": str(trace_path.resolve()) if trace_path else None,
                      "max_load_tokens_per_step": max_load_tokens_per_step if not base_urls else None},
        **settings)


def run_replay_experiment(config: ReplayConfig, server_config: Callable[[Path], ServerConfig] | None,
                          announce: Callable[[ServerConfig], Any] = lambda _: None,
                          on_note: Callable[[str], Any] = lambda _: None,
                          instances: InstancePlan | None = None) -> dict[str, Any]:
    """Replay `config` and return its summary: its result folder is this run's (locked, checked
    for --resume) before a server starts; `server_config(log_path)` makes the server to start
    (None: the running ones `config` names), `instances` of it when asked. Raises ServerError, ReplayError, ResultDirError,
    Interrupted; whatever was recorded stays on disk."""
    from kvbench.replay.result_lock import result_dir_lock
    from kvbench.replay.resume import check_result_dir

    result_dir = config.output.result_dir
    with result_dir_lock(result_dir, on_note=on_note):  # a second writer is refused at once
        check_result_dir(result_dir, config.output.resume)
        started = None if server_config is None else server_config(result_dir / "server.log")
        with replay_server(config, started, announce=announce, instances=instances) as bound:
            return replay_and_summarize(bound)
