"""A sweep's spec from what a command was given: each method's parameter grid expanded into
configurations (each looked up and checked once), the item tasks that have their data, a table's
defaults under the user's options, NonShared added where the comparison needs it. The CLI parses
flags into `options`; what they mean is decided here (`kvbench sweep` and `kvbench paper` alike)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping
from typing import Any

from kvbench.experiment.sweep import PLAIN_NONSHARED, MethodConfig, SweepSpec
from kvbench.run_files import AA_LABEL
from kvbench.tracegen.generate import task_model
from kvbench.tracegen.tasks.registry import benchmark_names, default_output_len, get_task

# The grid's axes with their defaults where neither the command nor a table gives them.
GRID_DEFAULTS = (("shared_tokens", [2048]), ("qps", [0.0]), ("agents", [4]), ("rounds", [1]))
TAKEN_AS_GIVEN = ("workflow", "num_warmups", "repeats", "seed", "quality", "temperature", "stop_on_saturation",
                  "instances", "routing", "shared_tier", "interleave")


class SweepInputError(ValueError):
    """What the command was given cannot make a sweep; `option` names the flag, where one is to blame."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


def method_configs(methods: list[str], param_specs: tuple[str, ...],
                   target_rhos: list[float] | None = None) -> list[MethodConfig]:
    """`kvcmas:V=5,10` (repeatable) -> one configuration per value combination of that method;
    with `target_rhos`, each configuration of a method with a threshold once per target (the
    others once: nothing to calibrate). Each configuration is resolved here, once."""
    grids: dict[str, dict[str, list[Any]]] = {m: {} for m in methods}
    for spec in param_specs:
        method, sep, rest = spec.partition(":")
        key, sep2, values = rest.partition("=")
        if not sep or not sep2 or method not in grids:
            raise SweepInputError(f"expected METHOD:KEY=V1,V2 for a method in --methods, got {spec!r}", "--method-param")
        grids[method][key] = [json.loads(v) if v.strip().replace(".", "", 1).lstrip("-").isdigit() else v
                              for v in values.split(",")]
    configs = []
    for method in methods:
        keys = sorted(grids[method])
        for combination in itertools.product(*(grids[method][k] for k in keys)):
            params = dict(zip(keys, combination))
            try:
                gate = MethodConfig(method, params).chosen.spec.threshold_name
            except ValueError as exc:
                raise SweepInputError(str(exc), "--method-param" if params else "--methods") from None
            if target_rhos and gate is not None and gate in params:
                raise SweepInputError(f"{method}:{gate} is what --target-rho calibrates; give one or the other",
                                      "--method-param")
            targets: list[float | None] = list(target_rhos) if target_rhos and gate is not None else [None]
            configs += [MethodConfig(method, params, target_rho=target) for target in targets]
    return configs


def runnable_benchmarks(tasks: list[str], files: Mapping[str, str],
                        on_note: Callable[[str], Any]) -> dict[str, str | None]:
    """The item tasks a sweep can run: those with a data file, given or their own."""
    runnable: dict[str, str | None] = {t: files.get(t) for t in tasks if t in files or get_task(t).has_default_data}
    left_out = [t for t in tasks if t not in runnable]
    if left_out:
        on_note(f"left out: {', '.join(left_out)} (no --data {left_out[0]}=PATH; docs/running.md says where to "
                "get the files)")
    if not runnable:
        raise SweepInputError("no benchmark task has its data: give --data TASK=PATH")
    return runnable


def build_sweep_spec(options: Mapping[str, Any], defaults: Mapping[str, Any],
                     on_note: Callable[[str], Any] = lambda _: None) -> SweepSpec:
    """The spec of a sweep from the command's parsed `options` over a table's `defaults` (empty for
    `kvbench sweep`; `options["adapters"]`: role -> adapter folder); SweepInputError names what
    cannot be run."""
    from kvbench.analysis.goodput import parse_goodput

    methods = options["methods"] or defaults.get("methods", ["nonshared", "fullshared"])
    # a table about one method's parameter (Table 13's V, Fig 13's ranks) keeps that method
    methods = [*methods, *(m for m in defaults.get("method_params", {}) if m not in methods)]
    param_specs = tuple(options["method_params"])
    for method, grid in defaults.get("method_params", {}).items():
        if not any(p.startswith(method + ":") for p in param_specs):
            param_specs += tuple(f"{method}:{key}={','.join(map(str, values))}" for key, values in grid.items())
    try:
        goodput = parse_goodput(options["goodput_specs"])
    except ValueError as exc:
        raise SweepInputError(str(exc), "--goodput") from None
    task, num_trajectories, data_files, limit = (options["task"], options["num_trajectories"], options["data_files"],
                                                 options["limit"])
    tasks = defaults.get("benchmarks") or ([task] if task in benchmark_names() else [])
    benchmarks = runnable_benchmarks(tasks, data_files, on_note) if tasks else {}
    if benchmarks:
        task = "none"  # each trace names its own task
        num_trajectories = limit or num_trajectories
    elif data_files or limit:
        raise SweepInputError(f"--data and --limit are for tasks that read items (--task {', '.join(benchmark_names())})")
    model = options["model"] or task_model(task)
    output_len = options["output_len"]
    if output_len is None:
        from kvbench.tracegen.tokenizer import load_tokenizer

        output_len = default_output_len(next(iter(benchmarks), task), load_tokenizer(model).encode)
    if options["quality"] and "nonshared" not in methods:
        # NonShared's own cells, at every QPS, are the noise floor of the quality figures under load
        on_note("note: --quality adds nonshared to --methods: its cells at each QPS show how much load alone "
                "changes the outputs")
        methods = ["nonshared", *methods]
    given = options["target_rhos"]
    target_rhos = [t for t in (given if given is not None else defaults.get("target_rhos", [])) if t is not None]
    spec = SweepSpec(
        methods=method_configs(methods, param_specs, target_rhos),
        **{key: (options[key] if options[key] is not None else defaults.get(key, default)) for key, default in GRID_DEFAULTS},
        **{key: options[key] for key in TAKEN_AS_GIVEN},
        **{"task": task, "model": model, "output_len": output_len},
        protocol=options["protocol"] or defaults.get("protocol", "free"),
        num_trajectories=num_trajectories or defaults.get("num_trajectories", 8),
        prime_method_state=options["prime_method_state"] or defaults.get("prime_method_state", False),
        save_prompt_ids=options["save_prompt_ids"] or defaults.get("save_prompt_ids", False), benchmarks=benchmarks,
        roles=options["roles"], goodput=goodput, adapters=dict(options["adapters"]))
    if options["aa"] and spec.interleave and PLAIN_NONSHARED in spec.methods:
        spec.methods.append(MethodConfig("nonshared", label=AA_LABEL))  # the noise floor (analysis/savings.py)
    return spec

