"""The distribution installs under the kvbench namespace and every CLI command answers --help."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from paths import ROOT

from kvbench.cli import main


@pytest.mark.parametrize("name, folder", [("kvbench", "kvbench"), ("kvbench.tracegen", "tracegen"),
                                          ("kvbench.replay", "replay"), ("kvbench.methods", "methods"),
                                          ("kvbench.methods.connector", "methods/connector"),
                                          ("kvbench.analysis", "analysis"), ("kvbench.model", "kvbench/model"),
                                          ("kvbench.cli", "kvbench/cli")])
def test_namespaced_packages_come_from_the_top_level_folders(name: str, folder: str) -> None:
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve() == ROOT / folder / "__init__.py"


def test_every_package_of_the_tree_is_in_the_distribution() -> None:
    """A folder with an __init__.py that pyproject.toml does not list is left out of a wheel or a
    non-editable install (an editable one still finds it: only a fresh install would fail)."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {package: Path(folder) for package, folder in setup["package-dir"].items()}
    found = set()
    for package, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            name = ".".join([package, *parts])
            if not any(name != other and name.startswith(other + ".") and (ROOT / folders[other]) == init.parent
                       for other in folders):
                found.add(name)
    assert found - set(setup["packages"]) == set()


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


# `kvbench vllm --help` is vLLM's own help (tests/engine/test_vllm_cli.py runs that command)
@pytest.mark.parametrize("path", [p for p in _all_command_paths(main) if p != ("vllm",)],
                         ids=lambda p: " ".join(p) or "kvbench")
def test_every_command_has_help(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(main, [*path, "--help"], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    assert "Usage: kvbench" in result.output


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "kvbench"  # what `pip install` put beside this Python
    assert script.exists(), f"no kvbench console script in {script.parent}"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "gen-trace" in result.stdout and "replay" in result.stdout and "methods" in result.stdout


def test_bad_seed_is_a_clear_click_error() -> None:
    result = CliRunner().invoke(main, ["model", "build", "--seed", "x"])
    assert result.exit_code == 2
    assert "Invalid value for '--seed'" in result.output


def test_unknown_flag_is_a_clear_click_error() -> None:
    result = CliRunner().invoke(main, ["model", "build", "--bogus"])
    assert result.exit_code == 2
    assert "No such option" in result.output


def test_help_lists_every_command_with_a_whole_phrase() -> None:
    """`kvbench --help` shows each command's short help: none cut mid-phrase (click cuts at the
    first period, e.g. the one in "e.g.")."""
    from click.testing import CliRunner

    from kvbench.cli import main

    listing = CliRunner().invoke(main, ["--help"]).output.split("Commands:")[1]
    assert "(e.g." not in listing and "vLLM's own CLI and benchmark client" in listing
    paper = CliRunner().invoke(main, ["paper", "--help"]).output
    assert "fig12: single-stream TTFT, throughput and memory (Tables 11-12)" in " ".join(paper.split())
