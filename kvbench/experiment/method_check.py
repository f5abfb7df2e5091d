"""`kvbench check`: on the user's hardware and model, every method at a setting where it must
equal a known computation (kvbench.experiment.invariants), each pass or fail with its evidence.

One server per method (started here, or one the user runs: `--base-url`); each invariant sets the
method's parameters on it (WorkerRpc.SET_PARAMS), empties its store (WorkerRpc.RESET) and restores
the parameters after. The workload is small and greedy: two-agent trajectories whose second agent
reuses the first's shared segments. Every pass is anchored on the dense reference's outputs (the
same prompts whatever the method does), so a turn's difference comes from its own cache. On the
same server, every compared turn is also prefilled by vLLM itself (nothing claimed: NonShared's
computation) and by kvbench's own forward of every row (claim "all"): the second measures how far
kvbench's forward alone sits from vLLM's, the noise floor the comparisons allow.
"""

from __future__ import annotations

import contextlib
import platform
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvbench.experiment.check_requests import (
    ADAPTER_PREFIX,
    CheckedServer,
    CheckSpec,
    TurnKey,
    TurnRun,
    check_trajectories,
    dense,
    only_query,
    run_pass,
    self_read,
    with_identity_adapters,
    without_adapters,
)
from kvbench.experiment.invariants import (
    CHECK_VERSION,
    DTYPE_EPS,
    Invariant,
    ModelFacts,
    Outcome,
    first_divergence,
    rope_ulps,
    rows_difference,
    worst_layer_excess,
)
from kvbench.server.errors import ServerError
from kvbench.tracegen.schema import Trajectory

LOGPROB_FLOOR = 0.02  # the smallest near-tie tolerance: one rounding of a logit near 4 in bf16
SAMPLED_ROWS = 64  # rows of each reused segment compared in the sampled layers
# Layer-0 keys re-aligned against a dense prefill's: a source rounding, the rotation's and the
# dense prefill's own rounding of RoPE (2 measured on vLLM's CPU backend; a GPU kernel rounds its
# own way); keys placed a position off are over 50 steps away.
ROPE_STEPS = 4.0


# ------------------------------------------------------------------------------ one server
@dataclass
class ServerCheck:
    """The invariants of one server's method, run against it; FullShared's placed rows and
    outputs are kept for the invariants compared with them (`fullshared`)."""

    server: CheckedServer
    spec: CheckSpec
    facts: ModelFacts
    tokenizer: Any
    fullshared: dict[TurnKey, dict[str, Any]] = field(default_factory=dict)
    _serial: int = 0
    _nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def run_id(self, name: str) -> str:
        """A run id no earlier check on this server used: it salts vLLM's prefix cache, so no pass
        reads blocks another check's pass computed."""
        self._serial += 1
        return f"check-{self._nonce}-{self._serial}-{name}"

    def sampled_layers(self) -> list[int]:
        last = self.facts.num_layers - 1
        return sorted({0, last // 2, last})

    def reused_rows(self, run: TurnRun) -> list[tuple[str, int, int]]:
        return [(s.id, s.start, s.start + min(s.length, SAMPLED_ROWS)) for s in run.plan.segments
                if s.kind == "ph" and s.source and s.length]

    def run(self, invariant: Invariant) -> Outcome:
        """The invariant's verdict; a request or RPC the server refuses is a failure naming it."""
        original = self.server.rpc.info()[0].params
        try:
            self.server.rpc.set_params(invariant.params(self.facts))
            # An empty store: an entry a server already held keeps the codec and the method state
            # it was kept with (a lossy codec's entry of the same query would be reused as is).
            self.server.rpc.reset()
            return self._evaluate(invariant)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            return _failed(Outcome(invariant.method, invariant.name, invariant.claim, "fail", ""),
                           f"the server refused a request: {_one_line(exc)}")
        finally:
            self.server.rpc.set_params(original)

    def _evaluate(self, invariant: Invariant) -> Outcome:
        trajectories = check_trajectories(self.spec, self.tokenizer)
        outcome = Outcome(invariant.method, invariant.name, invariant.claim, "pass", "")
        if invariant.workload == "identity-adapters":
            if missing := [f"{ADAPTER_PREFIX}{i}" for i in range(2) if f"{ADAPTER_PREFIX}{i}" not in self.server.models]:
                outcome.status, outcome.evidence = "skipped", f"the server does not serve {', '.join(missing)}"
                return outcome
            base = self.reference_pass(without_adapters(with_identity_adapters(trajectories)))
            runs = run_pass(self.server, with_identity_adapters(trajectories), self.tokenizer, self.run_id("method"),
                            reference=_outputs(base), plan_change=only_query)
            return self.against_dense(outcome, runs, base, {k: r for k, r in runs.items() if r.plan.sources})
        reference = self.reference_pass(trajectories)
        if invariant.workload == "self-read":
            first = {k: r for k, r in reference.items() if not r.plan.sources}
            plan_of, run_id = self_read(first, self.run_id("self")), self.run_id("self-read")
            runs = {k: self.server.complete(r.prompt, plan_of(k, r), len(r.tokens), adapter=r.plan.adapter)
                    for k, r in first.items()}
            return self.against_dense(outcome, runs, reference, runs, noise_run_id=run_id)
        runs = run_pass(self.server, trajectories, self.tokenizer, self.run_id("method"), reference=_outputs(reference))
        reused = {k: r for k, r in runs.items() if r.plan.sources}
        if invariant.method == "fullshared":
            self.keep_fullshared(reused)
        if invariant.name == "rope-realignment":
            return self.rope(outcome, reused, reference)
        if invariant.reference == "fullshared":
            return self.against_fullshared(outcome, reused, only_accepted=invariant.only_accepted)
        return self.against_dense(outcome, reused, reference, reused)

    def reference_pass(self, trajectories: Sequence[Trajectory]) -> dict[TurnKey, TurnRun]:
        """vLLM's own prefill of every turn (NonShared's computation), decoding freely: the
        outputs every other pass's prompts are built from."""
        return run_pass(self.server, trajectories, self.tokenizer, self.run_id("dense"), plan_change=dense)

    def against_dense(self, outcome: Outcome, runs: dict[TurnKey, TurnRun], reference: dict[TurnKey, TurnRun],
                      compared: dict[TurnKey, TurnRun], noise_run_id: str | None = None) -> Outcome:
        """Outputs token for token (a near-tie allowed) and K/V layer by layer within the noise
        floor, against the dense reference of the same prompts."""
        worst_ratio, worst_where, near_ties = 0.0, "", []
        noise_id = noise_run_id or self.run_id("own-forward")
        for key, run in compared.items():
            ref = reference[key]
            if run.prompt != ref.prompt:
                return _failed(outcome, f"{key[0]} {key[1]}: its prompt differs from the dense reference's")
            own = self.server.complete(ref.prompt, replace(ref.plan, claim="all", segments=(), prefix_sources=(),
                                                           save_as=f"{noise_id}/{key[0]}/{key[1]}"),
                                       len(ref.tokens), adapter=ref.plan.adapter)
            tolerance = max(LOGPROB_FLOOR, 2 * _max_logprob_difference(own, ref))
            divergence = first_divergence(run.tokens, ref.tokens, ref.top, tolerance)
            if divergence is not None and not divergence.near_tie:
                return _failed(outcome, f"{key[0]} {key[1]}: token {divergence.step} is {divergence.got}, NonShared's "
                               f"{divergence.expected} (log-prob margin {divergence.margin:.3g} > {tolerance:.3g})")
            if divergence is not None:
                near_ties.append(f"{key[1]} step {divergence.step}")
            stop = len(ref.prompt) - 1
            ratio, where = worst_layer_excess(self.server.kv_errors(run.key, ref.key, stop),
                                              self.server.kv_errors(own.plan.save_as or "", ref.key, stop))
            if ratio > worst_ratio or not worst_where:
                worst_ratio, worst_where = ratio, f"{key[0]} {key[1]} {where}"
            if ratio > 1:
                return _failed(outcome, f"K/V off the dense prefill: {worst_where}")
            outcome.turns += 1
        if not outcome.turns:
            return _failed(outcome, "no turn to compare")
        ties = f"; near-ties: {', '.join(near_ties)}" if near_ties else ""
        kv = ("K/V bit-identical to the dense prefill's" if worst_ratio == 0 else
              f"largest K/V difference {worst_ratio:.2f} of allowed ({worst_where})")
        outcome.evidence = f"outputs equal{ties}; {kv}"
        outcome.details = {"worst_kv_ratio": worst_ratio, "near_ties": near_ties}
        return outcome

    def rope(self, outcome: Outcome, runs: dict[TurnKey, TurnRun], reference: dict[TurnKey, TurnRun]) -> Outcome:
        """Layer 0's keys depend only on token and position: re-aligned reused keys must equal a
        dense prefill's to within ROPE_STEPS roundings of the cache dtype."""
        worst = 0.0
        for key, run in runs.items():
            for segment, start, stop in self.reused_rows(run):
                got = self.server.rows(run.key, 0, start, stop)["k"]
                expected = self.server.rows(reference[key].key, 0, start, stop)["k"]
                worst = max(worst, rope_ulps(got, expected, self.facts.dtype))
                if worst > ROPE_STEPS:
                    return _failed(outcome, f"{key[0]} {key[1]} segment {segment}: layer-0 keys {worst:.1f} "
                                   f"{self.facts.dtype} steps off the dense prefill's (allowed {ROPE_STEPS:g})")
            outcome.turns += 1
        if not outcome.turns:
            return _failed(outcome, "no reused segment to compare")
        outcome.evidence = f"layer-0 keys within {worst:.1f} {self.facts.dtype} steps of a dense prefill's"
        outcome.details = {"max_ulps": worst}
        return outcome

    def keep_fullshared(self, runs: dict[TurnKey, TurnRun]) -> None:
        for key, run in runs.items():
            self.fullshared[key] = {"prompt": run.prompt, "tokens": run.tokens, "rows": {
                (segment, layer): self.server.rows(run.key, layer, start, stop)
                for segment, start, stop in self.reused_rows(run) for layer in self.sampled_layers()}}

    def against_fullshared(self, outcome: Outcome, runs: dict[TurnKey, TurnRun], only_accepted: bool) -> Outcome:
        if not self.fullshared:
            outcome.status, outcome.evidence = "skipped", "needs FullShared's placed rows: check fullshared too"
            return outcome
        worst, eps = 0.0, DTYPE_EPS.get(self.facts.dtype, 2.0 ** -8)
        stats = self.server.request_stats() if only_accepted else {}
        cut_turns = 0
        for key, run in runs.items():
            if only_accepted and not _all_accepted(stats.get(run.key, {})):
                continue
            expected = self.fullshared.get(key)
            if expected is None or expected["prompt"] != run.prompt:
                return _failed(outcome, f"{key[0]} {key[1]}: not the prompt FullShared's server saw")
            # Accepted segments past the claim's stop were prefilled by vLLM (dense): the placed
            # ones are compared, and the outputs only where every segment was placed.
            dense = _prefilled_by_vllm(stats.get(run.key, {})) if only_accepted else set()
            cut_turns += bool(dense)
            for (segment, layer), rows in expected["rows"].items():
                if segment in dense:
                    continue
                start, stop = next((s, e) for name, s, e in self.reused_rows(run) if name == segment)
                got = self.server.rows(run.key, layer, start, stop)
                for half in ("k", "v"):
                    difference, scale = rows_difference(got[half], rows[half])
                    worst = max(worst, difference / max(scale, 1e-30))
                    if difference > eps * scale:
                        return _failed(outcome, f"{key[0]} {key[1]} segment {segment} layer {layer} {half}: largest "
                                       f"difference {difference:.3g} from FullShared's (allowed {eps * scale:.3g})")
            if not dense and run.tokens != expected["tokens"]:
                step = next(i for i, (a, b) in enumerate(zip(run.tokens, expected["tokens"])) if a != b)
                return _failed(outcome, f"{key[0]} {key[1]}: token {step} differs from FullShared's")
            outcome.turns += 1
        if not outcome.turns:
            return _failed(outcome, "no turn whose every reused segment was accepted (more --trajectories fill "
                           "the anchor pools)")
        outputs = ("outputs equal" if not cut_turns else
                   f"outputs equal in the {outcome.turns - cut_turns} turns with every segment placed; {cut_turns} had a "
                   "segment prefilled by vLLM past the claim (its placed segments compared)")
        outcome.evidence = ("placed K/V bit-identical to FullShared's" if worst == 0 else
                            f"placed K/V within {worst:.2g} (relative) of FullShared's") + "; " + outputs
        outcome.details = {"max_relative_difference": worst, "turns_with_vllm_prefilled_segments": cut_turns}
        return outcome


def _outputs(runs: dict[TurnKey, TurnRun]) -> dict[TurnKey, list[int]]:
    return {key: run.tokens for key, run in runs.items()}


def _failed(outcome: Outcome, evidence: str) -> Outcome:
    outcome.status, outcome.evidence = "fail", evidence
    return outcome


def _all_accepted(stats: dict[str, Any]) -> bool:
    decisions = stats.get("decisions") or []
    return bool(decisions) and all(d.get("decision") == "accepted" for d in decisions)


def _prefilled_by_vllm(stats: dict[str, Any]) -> set[str]:
    """Accepted segments past the claim's stop (prefilled by vLLM: dense, not placed)."""
    return {str(d.get("id")) for d in stats.get("decisions") or [] if d.get("prefilled_by_vllm")}


def _max_logprob_difference(a: TurnRun, b: TurnRun) -> float:
    """How far two decodes' log-probs sit apart over the steps where they still agree."""
    worst = 0.0
    for step, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        common = set(a.top[step]) & set(b.top[step])
        worst = max([worst, *(abs(a.top[step][t] - b.top[step][t]) for t in common)])
        if x != y:
            break
    return worst


# ------------------------------------------------------------------------------ the whole check
def model_facts(model: str) -> ModelFacts:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    text = getattr(config, "text_config", None) or config
    dtype = str(getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or "bfloat16").removeprefix("torch.")
    return ModelFacts(num_layers=int(text.num_hidden_layers), dtype=dtype if dtype in DTYPE_EPS else "bfloat16")


def run_checks(spec: CheckSpec, invariants: Sequence[Invariant],
               servers: Callable[[str], contextlib.AbstractContextManager[str]],
               progress: Callable[[str], None] = lambda _: None) -> list[Outcome]:
    """Every invariant on a server of its method (`servers(method)` yields its URL), FullShared's
    first when an invariant compares with it."""
    from kvbench.tracegen.tokenizer import load_tokenizer

    tokenizer, facts = load_tokenizer(spec.model), model_facts(spec.model)
    methods = list(dict.fromkeys(i.method for i in invariants))
    if any(i.reference == "fullshared" for i in invariants) and "fullshared" not in methods:
        methods.insert(0, "fullshared")
    methods.sort(key=lambda m: m != "fullshared")
    kept: dict[TurnKey, dict[str, Any]] = {}
    outcomes = []
    for method in methods:
        progress(f"{method}: starting or reaching its server")
        asked = [i for i in invariants if i.method == method]
        try:
            with servers(method) as url:
                server = CheckedServer(url)
                if server.method != method:
                    raise ValueError(f"{url} runs {server.method!r}, not {method!r}")
                check = ServerCheck(server, spec, facts, tokenizer, fullshared=kept)
                for invariant in asked or _reference_only(method):
                    progress(f"{method}: {invariant.name}")
                    outcome = check.run(invariant)
                    if invariant in asked:
                        outcomes.append(outcome)
                        progress(f"{method}: {invariant.name}: {outcome.status} ({outcome.evidence})")
        except ServerError as exc:  # e.g. a cache layout the connector refuses: the other methods go on
            why = f"its server did not start: {startup_failure(str(exc))}"
            progress(f"{method}: {why}")
            outcomes += [Outcome(i.method, i.name, i.claim, "fail", why) for i in asked]
    return outcomes


def startup_failure(message: str) -> str:
    """The line of a failed start-up that says why: the connector's refusal of the cache when
    there is one (kvbench.methods.core.paged.UnsupportedCacheError), else the first line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    refusal = [line for line in lines if "UnsupportedCacheError" in line or "MethodConfigError" in line]
    return (refusal or lines or ["(no message)"])[-1 if refusal else 0]


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    body = getattr(exc, "read", None)
    if callable(body):  # an HTTP error: the server's own message is in its body
        with contextlib.suppress(Exception):
            text = f"{text}: {body().decode(errors='replace')}"
    return f"{type(exc).__name__}: {' '.join(text.split())[:400]}"


def _reference_only(method: str) -> list[Invariant]:
    """FullShared run only to keep its placed rows (its own invariants were not asked for)."""
    from kvbench.experiment.invariants import INVARIANTS

    return [next(i for i in INVARIANTS if i.method == method and i.workload == "reuse")]


def check_report(spec: CheckSpec, outcomes: Sequence[Outcome], model_name: str | None = None) -> dict[str, Any]:
    """check.json: the verdicts, and what they ran on. `model_name`: the model as the user named
    it (the resolved path of an embedded one is this machine's alone)."""
    from kvbench import __version__
    from kvbench.model.store import model_identity
    from kvbench.replay.run_config import git_sha

    identity = model_identity(spec.model)
    spec_fields = {**spec.__dict__, "model": model_name or identity}
    return {"version": CHECK_VERSION, "passed": bool(outcomes) and all(o.status == "pass" for o in outcomes),
            "model": model_name or identity, "model_identity": identity, "spec": spec_fields,
            "kvbench_version": __version__, "git_sha": git_sha(), "host": platform.node(),
            "machine": platform.machine(), "outcomes": [o.to_dict() for o in outcomes]}

