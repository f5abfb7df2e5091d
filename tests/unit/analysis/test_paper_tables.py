"""Every `kvbench paper` renderer renders from its golden results folder (tests/data/golden-paper,
golden-table1), and every value of the paper it prints equals the paper's own text
(tests/data/kvcmas-paper-tables.txt: its tables' lines, verbatim). The paper's text is parsed
here, never through kvbench.analysis.paper.values, so a value mistyped there fails."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from paths import DATA, ROOT

from kvbench.analysis.paper import tables as paper

PAPER_TEXT = (DATA / "kvcmas-paper-tables.txt").read_text()
GOLDEN = DATA / "golden-paper"
# Each renderer and the folder it renders from; what it must draw.
RENDERS = {
    "table7": ("table7", ["fig5_p50_ttft.png", "fig8_p90_ttft.png", "fig6_chained.png"]),
    "fig5": ("table7", ["fig5.png"]), "fig6": ("table7", []), "fig8": ("table7", []),
    "table9": ("table7", ["fig9_chained_p90.png"]), "fig9": ("table7", []),
    "table10": ("table10", ["fig10.png", "fig11.png"]), "fig10": ("table10", []), "fig11": ("table10", []),
    "table11": ("table11", ["fig12_single_stream.png"]), "table12": ("table11", []), "fig12": ("table11", []),
    "table13": ("table13", []), "fig13": ("fig13", ["fig13.png"]),
    "table14": ("table14", []), "table15": ("table15", []),
    "table1": ("../golden-table1", []), "table4": ("../golden-table1", []), "fig4": ("../golden-table1", ["fig4.png"]),
    "table5": ("../golden-table1", []), "table6": ("table6", []), "table8": ("table8", []),
}


def _number(text: str) -> float | None:
    text = text.replace(",", "").replace("$\\times$", "").replace("×", "").strip()
    return None if text == "oom" else float(text)


def _is_number(text: str) -> bool:
    try:
        _number(text)
    except ValueError:
        return False
    return True


def _label(text: str) -> str:
    return text.replace("†", "").strip().lower()


def _block(caption: str) -> list[str]:
    """The lines of the paper's table whose caption starts with `caption` (up to the next caption)."""
    lines = PAPER_TEXT.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(caption))
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^Table \d+:", lines[i])), len(lines))
    return [line for line in lines[start + 1:end] if line.strip()]


def _tab_rows(caption: str, labels: int) -> dict[tuple[str, ...], list[float | None]]:
    """A tab-separated table: `labels` leading label columns (an empty one repeats the row above's)."""
    rows: dict[tuple[str, ...], list[float | None]] = {}
    carried = [""] * labels
    for line in _block(caption):
        cells = line.split("\t")
        if len(cells) <= labels or not all(_is_number(c) for c in cells[labels:] if c) or not any(cells[:labels]):
            continue  # a header row
        carried = [c or carried[i] for i, c in enumerate(cells[:labels])]
        rows[tuple(_label(c) for c in carried)] = [_number(c) for c in cells[labels:]]
    return rows


def _flat_rows(caption: str) -> dict[tuple[str, ...], list[float | None]]:
    """Tables 7 and 10 as the text flattens them: per sub-table '(a) ... 2K' a line of 'p50 Method
    21 numbers ... p90 ...'. Keys (size, pct, method)."""
    rows: dict[tuple[str, ...], list[float | None]] = {}
    size = ""
    for line in _block(caption):
        if line.startswith("("):
            size = re.search(r"([\d.]+[kK])", line).group(1).upper()  # type: ignore[union-attr]
            continue
        tokens = line.split()[line.split().index("Method") + 22:]
        pct, method = "", ""
        for token in tokens:
            if token in ("p50", "p90"):
                pct = token
            elif not _is_number(token):
                method = token
                rows[(_label(size), pct, _label(method))] = []
            else:
                rows[(_label(size), pct, _label(method))].append(_number(token))
    return rows


def _rendered(text: str, title: str, labels: int) -> dict[tuple[str, ...], list[float | None]]:
    """The rows of the paper's table printed under a heading containing `title`."""
    sections = [s for s in text.split("### ")[1:] if s.startswith("the paper") and title in s.splitlines()[0]]
    assert sections, f"no paper section {title!r} in the rendered text"
    rows = {}
    for line in sections[0].splitlines()[4:]:  # after the heading, a blank line, the header and its rule
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[tuple(_label(c) for c in cells[:labels])] = [_number(c) for c in cells[labels:]]
    return rows


def _render(name: str, tmp_path: Path) -> str:
    folder, _ = RENDERS[name]
    return paper.render(name, (GOLDEN / folder).resolve(), tmp_path).read_text()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[str, Path]]:
    """Each entry rendered once for the module's tests: (its text, its folder)."""
    root, cache = tmp_path_factory.mktemp("paper"), {}

    def get(name: str) -> tuple[str, Path]:
        if name not in cache:
            cache[name] = (_render(name, root / name), root / name)
        return cache[name]
    return get


def test_paper_help_lists_every_table_and_figure_with_numbers() -> None:
    numbered = {f"table{n}" for n in range(1, 16)} | {f"fig{n}" for n in range(2, 14)}
    assert numbered - set(paper.TABLES) == {"table3"}  # settings, not results (its counts are the runbook's)
    assert "table3" in paper.NOT_COVERED and "table1b" in paper.NOT_COVERED


@pytest.mark.parametrize("name", sorted(RENDERS))
def test_every_renderer_renders_from_its_golden_folder(name: str, rendered: Callable[[str], tuple[str, Path]]) -> None:
    text, tmp_path = rendered(name)
    measured = pd.read_csv(tmp_path / f"{name}.csv")  # the grid points the table averaged
    assert len(measured) and all(f"| {config}" in text for config in set(measured["method_config"])
                                 if name not in ("table9", "fig9") or "kvcmas" in config)
    for figure in RENDERS[name][1]:
        assert (tmp_path / figure).stat().st_size > 0 and f"]({figure})" in text
    if RENDERS[name][0] in ("table7", "table10"):
        assert "Protocol: paper, the paper's (Appendix B.4)" in text
    elif RENDERS[name][0] in ("table11", "table13", "fig13", "table14", "table15"):
        assert "Protocol: paper-decode" in text


def test_table7_and_table10_print_the_papers_ttft(rendered: Callable[[str], tuple[str, Path]]) -> None:
    assert _rendered(rendered("table7")[0], "Table 7", 3) == _flat_rows("Table 7:")
    assert _rendered(rendered("table10")[0], "Table 10", 3) == _flat_rows("Table 10:")


def test_fig5_pairs_selective_recomputation_with_delta_correction(rendered: Callable[[str], tuple[str, Path]]) -> None:
    text, table7 = rendered("fig5")[0], _flat_rows("Table 7:")
    columns = {0.9: slice(0, 7), 0.8: slice(7, 14), 0.6: slice(14, 21)}
    for pair in ((0.9, 0.8), (0.8, 0.6)):
        printed = _rendered(text, f"rho {pair[0]:g} / {pair[1]:g}", 3)
        assert {key[:2] for key in printed} == {("2k", "nonshared"), ("8k", "nonshared")} | {
            (c, m) for c in ("2k", "8k") for m in ("fullshared", "droidspeak", "cacheblend", "relaycaching",
                                                   "graphflow", "kvcmas")} | {("2k", "kvcomm")}
        for (size, method, rho), values in printed.items():
            if method in ("nonshared", "fullshared"):  # no reuse ratio: the same values in every rho column
                assert rho == "–" and values == table7[(size, "p50", method)][columns[pair[1]]]
                continue
            selective = method in ("droidspeak", "cacheblend", "relaycaching")
            assert float(rho) == (pair[0] if selective else pair[1])
            assert values == table7[(size, "p50", method)][columns[float(rho)]]


def test_table9_and_the_single_stream_tables_print_the_papers_values(rendered: Callable[[str], tuple[str, Path]]) -> None:
    assert _rendered(rendered("table9")[0], "Table 9", 3) == _tab_rows("Table 9:", 3)
    single = rendered("table12")[0]
    assert _rendered(single, "Table 11", 2) == _tab_rows("Table 11:", 2)
    assert _rendered(single, "Table 12", 2) == _tab_rows("Table 12:", 2)
    assert _rendered(rendered("table13")[0], "Table 13", 1) == _tab_rows("Table 13:", 1)
    assert _rendered(rendered("table14")[0], "Table 14", 1) == _tab_rows("Table 14:", 1)
    assert _rendered(rendered("table15")[0], "Table 15", 1) == _tab_rows("Table 15:", 1)


def test_the_accuracy_tables_print_the_papers_llm_columns(rendered: Callable[[str], tuple[str, Path]]) -> None:
    table1 = _flat_table1()
    text = rendered("table1")[0]
    for index, title in enumerate(["final-answer accuracy", "mean workflow latency", "TTFT", "peak memory",
                                   "realized rho"]):
        printed = _rendered(text, title, 1)
        assert printed == {m: values[index::5] for m, values in table1.items()}, title
    assert list(_rendered(text, "final-answer accuracy", 1))[5:7] == [("graphflow",), ("kvcomm",)]  # its order
    llm = {key: values[:6] for key, values in _tab_rows("Table 4:", 1).items()}
    assert _rendered(rendered("table4")[0], "Table 4", 1) == llm
    assert _rendered(rendered("table5")[0], "Table 5", 1) == {k: v[:3] for k, v in _tab_rows("Table 5:", 1).items()}
    table6 = [line.split("\t")[:3] for line in _block("Table 6:") if _is_number(line.split("\t")[0])]
    assert _rendered(rendered("table6")[0], "Table 6", 1) == {(t,): [_number(a), _number(r)] for t, a, r in table6}
    table8 = {(_label(line.split("\t")[0]),): [_number(line.split("\t")[1])] for line in _block("Table 8:")[1:]}
    assert _rendered(rendered("table8")[0], "Table 8", 1) == table8
    fig4 = _rendered(rendered("fig4")[0], "Fig. 4", 2)
    assert fig4 == {(task, method): [values[1 + 5 * i], values[5 * i]] for (method,), values in table1.items()
                    for i, task in enumerate(("mmlu", "gsm8k"))}  # (latency, accuracy) per task


def _flat_table1() -> dict[tuple[str, ...], list[float | None]]:
    """Table 1(a): one line, 'NonShared' then 15 numbers (accuracy, latency, TTFT, memory, rho per task)."""
    line = next(line for line in _block("Table 1:") if line.startswith("MMLU GSM8K"))
    rows: dict[tuple[str, ...], list[float | None]] = {}
    for token in line.split()[line.split().index("Method") + 16:]:
        if _is_number(token):
            rows[list(rows)[-1]].append(_number(token))
        else:
            rows[(_label(token),)] = []
    return rows


def test_table2_prints_the_papers_coverage() -> None:
    printed = _rendered("\n".join(paper.table2_paper_lines()), "Table 2", 1)
    assert printed == {(f"{k[0]}",): v for k, v in _tab_rows("Table 2:", 1).items() if "llava" not in k[0]}


def test_a_value_mistyped_in_paper_values_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbench.analysis.paper import values_serving as paper_values_serving

    typo = paper_values_serving._TABLE7[(8192, "p50")].replace("8.15", "8.51", 1)
    monkeypatch.setitem(paper_values_serving._TABLE7, (8192, "p50"), typo)
    assert _rendered(_render("table7", tmp_path), "Table 7", 3) != _flat_rows("Table 7:")


def _paper_text() -> Path | None:
    """The paper's full text: KVBENCH_PAPER_TEXT, else where the project's CI keeps it beside the
    checkout (../shared/reference/kvcmas-paper.txt); None on a machine that has neither."""
    given = os.environ.get("KVBENCH_PAPER_TEXT")
    beside = ROOT.parent / "shared" / "reference" / "kvcmas-paper.txt"
    return Path(given) if given else beside if beside.is_file() else None


@pytest.mark.skipif(_paper_text() is None, reason="the paper's full text: KVBENCH_PAPER_TEXT or "
                    "../shared/reference/kvcmas-paper.txt")
def test_the_excerpt_is_the_papers_text() -> None:
    full = _paper_text().read_text().splitlines()  # type: ignore[union-attr]
    missing = [line for line in PAPER_TEXT.splitlines() if line not in full]
    assert not missing, f"lines of the excerpt that are not the paper's: {missing[:5]}"


def test_paper_all_renders_every_entry_with_a_manifest(tmp_path: Path) -> None:
    """`kvbench paper all --results DIR` over a `paper all --run` folder (here the golden sweeps
    laid out as it lays them out): every entry rendered from its group's sweep, one that has no
    sweep recorded as failed with why, manifest.json naming the commit, host and device."""
    import shutil

    from click.testing import CliRunner

    from kvbench.cli import main
    from kvbench.cli.paper import sweep_groups

    groups = sweep_groups()
    assert groups["table7"] == ["table7", "fig5", "fig8"] and groups["table9"] == ["fig6", "table9", "fig9"]
    assert groups["table11"] == ["table11", "table12", "fig12"] and set(groups["table2"]) == {"fig2", "fig3", "table2", "fig7"}
    assert sorted(n for names in groups.values() for n in names) == sorted(paper.TABLES)  # each entry once
    runs = tmp_path / "all"
    for group in groups:
        source = {"table9": "table7", "table1": "../golden-table1", "table5": "../golden-table1"}.get(group, group)
        if (GOLDEN / source).is_dir() and group != "table2":
            target = runs / group if (GOLDEN / source / "sweep-out128").is_dir() or (GOLDEN / source / "sweep").is_dir() \
                else runs / group / "sweep"
            shutil.copytree(GOLDEN / source, target)
    result = CliRunner().invoke(main, ["paper", "all", "--results", str(runs), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "4 entries did not render: fig2, fig3, table2, fig7" in result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["device"].startswith(("cpu", "cuda")) and manifest["command"] == "kvbench paper all"
    assert set(manifest) >= {"kvbench_version", "git_sha", "host", "model", "started", "finished"}
    statuses = {name: entry["status"] for name, entry in manifest["entries"].items()}
    assert statuses == {name: "failed" if name in groups["table2"] else "rendered" for name in paper.TABLES}
    assert "no " in manifest["entries"]["fig2"]["reason"] and manifest["entries"]["table9"]["grid_of"] == "table9"
    for name, entry in manifest["entries"].items():
        if entry["status"] == "rendered":
            assert Path(entry["table"]).read_text().startswith(f"# {paper.TABLES[name].title}")
