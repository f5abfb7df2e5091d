"""`kvbench model ...`: build and locate the embedded default model."""

from __future__ import annotations

import json

import click

from kvbench.model.spec import TinyModelSpec
from kvbench.model.store import DEFAULT_SEED, is_built, model_dir_for


@click.group("model")
def model_group() -> None:
    """The embedded default model: a tiny Llama built and trained locally by kvbench."""


@model_group.command("build")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True,
              help="Training seed; the same seed gives bit-identical weights on the same machine type.")
@click.option("--train-steps", type=click.IntRange(min=1), default=None,
              help=f"AdamW steps [default: {TinyModelSpec().train_steps}]. Non-default values build a separate model.")
@click.option("--force", is_flag=True, help="Rebuild even if a built model is cached.")
def build_command(seed: int, train_steps: int | None, force: bool) -> None:
    """Build (tokenizer + training, ~3 min on 2 cores) and cache the model; print its manifest."""
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


@model_group.command("path")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True, help="Seed of the model to locate.")
@click.option("--build/--no-build", default=True, show_default=True,
              help="Build the model first if it is not cached; with --no-build a missing model is an error.")
def path_command(seed: int, build: bool) -> None:
    """Print the directory of the embedded model (loadable by vLLM and transformers)."""
    spec = TinyModelSpec()
    path = model_dir_for(spec, seed)
    if not is_built(path):
        if not build:
            raise click.ClickException(f"model not built: {path} (run `kvbench model build --seed {seed}`)")
        from kvbench.model.build import build_model

        click.echo(f"building the embedded model into {path} ...", err=True)
        build_model(spec, seed, path)
    click.echo(str(path))
