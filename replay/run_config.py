"""What a replay is asked to do (ReplayConfig), and the record of what it did: a run's config.json
(its provenance: method, sampling, trace, tokenizer, versions, host) and the checks that a
resumed run replays what the interrupted one did."""

from __future__ import annotations

import dataclasses
import platform
import secrets
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvbench import __version__
from kvbench.methods.api.spec import ChosenMethod
from kvbench.model.store import model_identity
from kvbench.replay.local_servers import listening_pids
from kvbench.replay.machine_load import describe_machine
from kvbench.replay.reference import ReferenceRun, trajectory_digests
from kvbench.replay.sampling import SamplingParams
from kvbench.replay.saturation import SaturationRule
from kvbench.tracegen.schema import Trace
from kvbench.tracegen.tokenizer import TraceTokenizer


class ReplayError(RuntimeError):
    """A replay could not run or finish; finished requests are on disk regardless."""


@dataclass(frozen=True)
class ReplayOutcome:
    """A finished run: its files are in `result_dir` (`kvbench.analysis.summary` summarizes them)."""

    result_dir: Path
    completed: int
    failed: int


@dataclass(frozen=True)
class LoadSettings:
    """How the requests are sent: arrivals, concurrency, warm-ups, timeouts."""

    qps: float = 1.0
    arrival: str = "poisson"
    burstiness: float = 1.0
    use_trace_timestamps: bool = False
    seed: int = 0
    max_concurrency: int | None = None
    num_warmups: int = 0
    # Warm-ups also prime the method's online state (anchor pools...): measures the steady state
    # rather than a cold start. vLLM's prefix cache and saved source caches are reset either way.
    prime_method_state: bool = False
    request_timeout_s: float = 600.0
    # A shared segment no predecessor holds is read from a concurrent turn sent first, once that
    # turn's prompt is computed (PromptBuilder.concurrent_sources). False: such turns prefill it.
    concurrent_sources: bool = True
    # Which server each request goes to when there are several (kvbench.replay.routing).
    routing: str = "trajectory"
    # A loaded run whose backlog and TTFT grow without bound by this rule stops early, marked
    # saturated (kvbench.replay.saturation): its figures would measure how long it ran, not the
    # server. None: it runs to its end whatever happens.
    saturation: SaturationRule | None = None


@dataclass(frozen=True)
class QualitySettings:
    """What the outputs are and what they are compared with."""

    sampling: SamplingParams = field(default_factory=SamplingParams)  # greedy by default
    # Reference-anchored replay: later turns read the reference run's outputs, not this run's.
    reference: ReferenceRun | None = None
    # Each request stops at its first generated token (the paper's protocol; replay/protocol.py).
    first_token_only: bool = False
    drop_shared: bool = False  # every shared segment left out of every prompt (PGR's floor)
    logprobs: int = 0  # top-K logprobs of each first generated token, recorded (0: none)
    # Also keeps every turn's cache on the server, those no later turn reads too: KV-error and
    # fidelity measurements need both (they rebuild each prompt and compare its cache afterwards).
    save_prompt_ids: bool = False


@dataclass(frozen=True)
class OutputSettings:
    """Where and how the run is recorded."""

    result_dir: Path
    label: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    metric_percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    goodput: dict[str, float] = field(default_factory=dict)  # latency bounds in ms (kvbench.analysis.goodput)
    resume: bool = False
    extra_config: dict[str, Any] = field(default_factory=dict)  # model, method parameters, server args
    show_progress: bool = True


@dataclass(frozen=True)
class ServerBinding:
    """The servers a replay runs against: their URLs, and for servers kvbench started, their pids
    and a check that returns a reason once one has died (then no new work is started)."""

    base_urls: list[str]
    pids: dict[str, int] = field(default_factory=dict)
    failure: Callable[[], str | None] = lambda: None
    # the shared tier's Mooncake master, whose /metrics page is sampled with the servers' (None: none known)
    tier_url: str | None = None

    @property
    def sampled_urls(self) -> list[str]:
        """Every URL whose /metrics page the run samples."""
        return self.base_urls + ([self.tier_url] if self.tier_url else [])

    def found_pids(self) -> dict[str, int]:
        """URL -> pid of each local server kvbench did not start (`kvbench serve` in another
        shell), found by its port: its CPU is the run's own, not a neighbour's."""
        return listening_pids([url for url in self.base_urls if url not in self.pids])


_PARTS = {"load": LoadSettings, "quality": QualitySettings, "output": OutputSettings}


@dataclass(frozen=True)
class ReplayConfig:
    """What a replay is asked to do, in the parts that change together; immutable once built
    (`with_servers` gives the copy a started server binds)."""

    trace: Trace
    tokenizer: TraceTokenizer
    method: ChosenMethod
    servers: ServerBinding
    output: OutputSettings
    load: LoadSettings = field(default_factory=LoadSettings)
    quality: QualitySettings = field(default_factory=QualitySettings)

    @classmethod
    def build(cls, trace: Trace, tokenizer: TraceTokenizer, method: ChosenMethod, base_urls: list[str], result_dir: Path,
              server_pids: dict[str, int] | None = None,
              server_failure: Callable[[], str | None] | None = None, server_tier_url: str | None = None,
              **settings: Any) -> ReplayConfig:
        """A config from flat settings, each sorted into its part (a name no part has is refused)."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in _PARTS}
        for key, value in settings.items():
            owner = next((name for name, part in _PARTS.items() if key in part.__dataclass_fields__), None)
            if owner is None:
                raise TypeError(f"ReplayConfig has no setting {key!r}")
            parts[owner][key] = value
        servers = ServerBinding(list(base_urls), dict(server_pids or {}), server_failure or (lambda: None), server_tier_url)
        return cls(trace=trace, tokenizer=tokenizer, method=method, servers=servers,
                   output=OutputSettings(result_dir=result_dir, **parts["output"]),
                   load=LoadSettings(**parts["load"]), quality=QualitySettings(**parts["quality"]))

    def with_servers(self, servers: ServerBinding, **extra_config: Any) -> ReplayConfig:
        """This config against `servers`, with what they add to config.json (their command)."""
        output = dataclasses.replace(self.output, extra_config={**self.output.extra_config, **extra_config})
        return dataclasses.replace(self, servers=servers, output=output)


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def prompt_mode(cfg: ReplayConfig) -> str:
    """free (each turn reads this run's own upstream outputs), reference or drop_shared."""
    if cfg.quality.reference is not None:
        return "reference"
    return "drop_shared" if cfg.quality.drop_shared else "free"


def protocol_name(cfg: ReplayConfig) -> str:
    """The measurement protocol (replay/protocol.py) the run's settings make."""
    if cfg.quality.reference is None:
        return "free"
    return "paper" if cfg.quality.first_token_only else "paper-decode"


def new_run_config(cfg: ReplayConfig) -> dict[str, Any]:
    """A new run's config.json: what it replays and how, and where it ran (provenance)."""
    stamp = datetime.now(UTC)
    return {
        "run_id": f"{cfg.output.label or cfg.method.name}-{stamp:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}",
        "date": f"{stamp:%Y%m%d-%H%M%S}",
        "method": cfg.method.name,
        "label": cfg.output.label,
        "metadata": cfg.output.metadata,
        "base_urls": cfg.servers.base_urls,
        "request_rate": cfg.load.qps,
        "arrival": cfg.load.arrival,
        "burstiness": cfg.load.burstiness,
        "use_trace_timestamps": cfg.load.use_trace_timestamps,
        "max_concurrency": cfg.load.max_concurrency,
        "num_warmups": cfg.load.num_warmups,
        "prime_method_state": cfg.load.prime_method_state,
        "num_trajectories": len(cfg.trace.trajectories) - cfg.load.num_warmups,
        "seed": cfg.load.seed,
        "metric_percentiles": cfg.output.metric_percentiles,
        "goodput": cfg.output.goodput,
        "sampling": cfg.quality.sampling.to_dict(),
        "logprobs": cfg.quality.logprobs,
        "prompt_mode": prompt_mode(cfg),
        "protocol": protocol_name(cfg),
        "concurrent_sources": cfg.load.concurrent_sources,
        "routing": cfg.load.routing,
        "reference_run": cfg.quality.reference.describe() if cfg.quality.reference is not None else None,
        "trajectory_digests": trajectory_digests(cfg.trace.trajectories),
        "request_timeout_s": cfg.load.request_timeout_s,
        "stop_on_saturation": cfg.load.saturation.to_dict() if cfg.load.saturation is not None else None,
        "trace_header": cfg.trace.header.model_dump(mode="json"),
        "tokenizer": cfg.tokenizer.name,
        "kvbench_version": __version__,
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "host": platform.node(),
        "machine": describe_machine(),
        "segments": [],
        **cfg.output.extra_config,
        # the model as `kvbench quality` compares it, readable after the path has gone (given, where
        # the recorded path is another machine's: a sweep cell run on a cluster worker)
        "model_identity": (cfg.output.extra_config.get("model_identity")
                           or model_identity(cfg.output.extra_config.get("model"))),
    }


def check_resumable(run_config: dict[str, Any], cfg: ReplayConfig) -> None:
    """A resumed run must replay what the interrupted one did: same method, sampling and prompts."""
    result_dir = cfg.output.result_dir
    if run_config["method"] != cfg.method.name:
        raise ReplayError(f"--resume: {result_dir} holds a {run_config['method']!r} run, not {cfg.method.name!r}")
    recorded = SamplingParams.from_dict(run_config.get("sampling"))
    if recorded != cfg.quality.sampling:
        raise ReplayError(f"--resume: {result_dir} was sampled with {recorded.to_dict()}, not {cfg.quality.sampling.to_dict()}")
    if run_config.get("concurrent_sources", True) != cfg.load.concurrent_sources:
        flag = "--concurrent-sources" if run_config.get("concurrent_sources", True) else "--no-concurrent-sources"
        raise ReplayError(f"--resume: {result_dir} was replayed with {flag}; resume it with the same")
    if run_config.get("routing", "trajectory") != cfg.load.routing:
        raise ReplayError(f"--resume: {result_dir} was routed with --routing {run_config.get('routing', 'trajectory')}; "
                          "resume it with the same")
    if run_config.get("protocol", "free") != protocol_name(cfg):
        raise ReplayError(f"--resume: {result_dir} was replayed under --protocol {run_config.get('protocol', 'free')}, "
                          f"not {protocol_name(cfg)}; resume it with the same")
    if run_config.get("prompt_mode", "free") != prompt_mode(cfg):
        raise ReplayError(f"--resume: {result_dir} was replayed in {run_config.get('prompt_mode', 'free')!r} "
                          f"mode, not {prompt_mode(cfg)!r}")
