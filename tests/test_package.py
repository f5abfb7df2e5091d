"""The distribution installs under the kvbench namespace and every CLI command answers --help."""

from __future__ import annotations

import importlib
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from kvbench.cli import main


@pytest.mark.parametrize("name", ["kvbench", "kvbench.tracegen", "kvbench.replay", "kvbench.methods",
                                  "kvbench.analysis", "kvbench.model", "kvbench.cli"])
def test_namespaced_packages_import(name: str) -> None:
    assert importlib.import_module(name).__name__ == name


@pytest.mark.parametrize("bare", ["methods", "analysis", "tracegen", "replay"])
def test_no_bare_top_level_import_names(bare: str, tmp_path) -> None:
    # Run outside the source tree so the repository root is not on sys.path.
    result = subprocess.run([sys.executable, "-c", f"import {bare}"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr


def _all_command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [prefix]
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            paths += _all_command_paths(command, prefix + (name,))
        else:
            paths.append(prefix + (name,))
    return paths


@pytest.mark.parametrize("path", _all_command_paths(main), ids=lambda p: " ".join(p) or "kvbench")
def test_every_command_has_help(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(main, [*path, "--help"], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    assert "Usage: kvbench" in result.output


def test_console_script_is_installed() -> None:
    result = subprocess.run([sys.executable, "-m", "kvbench", "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "gen-trace" in result.stdout or "model" in result.stdout


def test_bad_seed_is_a_clear_click_error() -> None:
    result = CliRunner().invoke(main, ["model", "build", "--seed", "x"])
    assert result.exit_code == 2
    assert "Invalid value for '--seed'" in result.output


def test_unknown_flag_is_a_clear_click_error() -> None:
    result = CliRunner().invoke(main, ["model", "build", "--bogus"])
    assert result.exit_code == 2
    assert "No such option" in result.output
