"""The docs' code works as written, and the README's method table is the registry's."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from kvbench.methods import registry

ROOT = Path(__file__).resolve().parent.parent


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_adding_a_method_example_registers_and_passes_its_test(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    method_code, test_code = _python_blocks(ROOT / "docs" / "adding-a-method.md")
    monkeypatch.setattr(registry, "_METHODS", dict(registry.all_methods()))  # the example's registration stays here
    module_path = tmp_path / "recompute_head.py"
    module_path.write_text(method_code)
    spec = importlib.util.spec_from_file_location("recompute_head", module_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "recompute_head", module)
    spec.loader.exec_module(module)

    cls = registry.method_class("recompute-head")
    assert cls is module.RecomputeHead and cls.approximate
    assert cls({}).params == {"head_tokens": 16, "store_codec": "none"}  # every method: store_codec
    with pytest.raises(ValueError, match="head_tokens: Input should be greater than or equal to 0"):
        cls({"head_tokens": -1})
    namespace: dict = {}
    exec(compile(test_code, "docs/adding-a-method.md", "exec"), namespace)
    namespace["test_the_head_of_each_shared_segment_is_computed"]()


def test_readme_method_table_is_the_registry() -> None:
    readme = (ROOT / "README.md").read_text()
    assert registry.methods_table() in readme, "regenerate it with `kvbench methods --markdown`"


def test_every_doc_link_resolves() -> None:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target:
                assert (path.parent / target).exists(), f"{path.name}: broken link {target}"
