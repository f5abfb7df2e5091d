"""The docs' code works as written, and the README's method table is the registry's."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest
from paths import ROOT

from kvbench.methods import registry


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def _load(code: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """`code` imported as module `name` for this test only (where the page saves it)."""
    path = tmp_path / f"{name.rsplit('.', 1)[-1]}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def recompute_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> type:
    """The page's spec and implementation, registered for this test only."""
    spec_code, method_code, _ = _python_blocks(ROOT / "docs" / "adding-a-method.md")
    monkeypatch.setattr(registry, "_METHODS", dict(registry.all_methods()))  # the example's registration stays here
    spec = _load(spec_code, "kvbench.methods.specs.recompute_head", tmp_path, monkeypatch).SPEC
    implementation = _load(method_code, "kvbench.methods.recompute_head", tmp_path, monkeypatch).RecomputeHead
    registry.register(spec)
    return implementation


def test_adding_a_method_example_registers_and_passes_its_test(recompute_head: type) -> None:
    _, _, test_code = _python_blocks(ROOT / "docs" / "adding-a-method.md")
    cls = registry.method_class("recompute-head")
    assert cls is recompute_head and cls.approximate and cls.name == "recompute-head"
    assert cls({}).params == {"head_tokens": 16, "store_codec": "none"}  # every method: store_codec
    with pytest.raises(ValueError, match="head_tokens: Input should be greater than or equal to 0"):
        cls({"head_tokens": -1})
    namespace: dict = {}
    exec(compile(test_code, "docs/adding-a-method.md", "exec"), namespace)
    namespace["test_the_head_of_each_shared_segment_is_computed"]()


def test_adding_a_method_commands_run_as_written(recompute_head: type, tiny_tokenizer_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 3's commands, each with a stand-in server (`--base-url`: no vLLM here) and one small
    trajectory; they must name folders the earlier commands wrote."""
    from click.testing import CliRunner

    from kvbench.cli import main
    from kvbench.replay.stub import StubServer

    (block,) = re.findall(r"## 3\..*?```bash\n(.*?)```", (ROOT / "docs" / "adding-a-method.md").read_text(), flags=re.S)
    commands = [shlex.split(line.split("#")[0]) for line in block.splitlines() if line.strip()]
    assert all(command[0] == ".venv/bin/kvbench" for command in commands)
    monkeypatch.chdir(tmp_path)
    with StubServer() as plain, StubServer(connector=True, connector_method="recompute-head") as connector:
        for command in commands:
            args = command[1:]
            if args[0] == "replay":
                server = connector if "recompute-head" in args else plain
                args += ["--base-url", server.base_url, "--model", str(tiny_tokenizer_dir), "--num-trajectories", "1",
                         "--shared-tokens", "64", "--output-len", "4"]
            result = CliRunner().invoke(main, args, prog_name="kvbench")
            assert result.exit_code == 0, (command, result.output)
            if args[:2] == ["methods", "--markdown"]:
                assert "recompute-head" in result.output
    summary = json.loads((tmp_path / "results" / "recompute-head" / "summary.json").read_text())
    assert summary["method"] == "recompute-head" and summary["exact_match_rate"] == 1.0  # the stand-in changes nothing
    assert (tmp_path / "reports" / "recompute-head" / "report.md").is_file()


def test_adding_a_task_example_registers_and_passes_its_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbench.tracegen.tasks import registry as tasks

    task_code, test_code = _python_blocks(ROOT / "docs" / "adding-a-task.md")
    monkeypatch.setattr(tasks, "_TASKS", dict(tasks.all_tasks()))  # the example's registration stays here
    task = _load(task_code, "kvbench.tracegen.tasks.needle", tmp_path, monkeypatch).TASK
    tasks.register(task)
    assert tasks.get_task("needle") is task and "needle" in tasks.task_names()
    namespace: dict = {}
    exec(compile(test_code, "docs/adding-a-task.md", "exec"), namespace)
    namespace["test_every_agent_is_asked_the_passcode_in_the_context"]()


def test_readme_method_table_is_the_registry() -> None:
    readme = (ROOT / "README.md").read_text()
    assert registry.methods_table() in readme, "regenerate it with `kvbench methods --markdown`"


def test_every_doc_link_resolves() -> None:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target:
                assert (path.parent / target).exists(), f"{path.name}: broken link {target}"
