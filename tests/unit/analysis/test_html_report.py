"""`kvbench report --html` (issue 51 item 5): one self-contained file, rendered by a real headless
browser (Debian's chromium-headless-shell, which scripts/install.sh installs where it can): every
plot decodes, the page logs no console error, and a screenshot comes out."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest
from click.testing import CliRunner
from paths import DATA

from kvbench.cli import main

GOLDEN = DATA / "golden-runs"
BROWSER = "chromium-headless-shell"


def _browser() -> str:
    path = shutil.which(BROWSER)
    if path is None:
        if os.environ.get("KVBENCH_SKIP_BROWSER"):
            pytest.skip(f"{BROWSER} is not installed (KVBENCH_SKIP_BROWSER set)")
        pytest.fail(f"{BROWSER} is not installed: apt-get install {BROWSER} (scripts/install.sh does as root), "
                    "or set KVBENCH_SKIP_BROWSER=1")
    return path


def _render(browser: str, page: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([browser, "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", *args,
                           page.resolve().as_uri()], capture_output=True, text=True, timeout=120, check=True)


def test_the_html_report_is_one_file_a_browser_renders_whole(tmp_path: Path) -> None:
    browser = _browser()
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["report", str(GOLDEN), "-o", str(out), "--html", "--title", "golden <runs>"])
    assert result.exit_code == 0, result.output
    page = out / "report.html"
    text = page.read_text()
    # self-contained: every image inline, nothing fetched from elsewhere
    sources = re.findall(r'src="([^"]*)"', text)
    assert len(sources) == 4 and all(s.startswith("data:image/png;base64,") for s in sources)
    assert "href=" not in text and "golden &lt;runs&gt;" in text  # the title escaped
    assert "<table>" in text and "p50_ttft_ms" in text and "git_sha" in text  # tables and provenance
    dom = _render(browser, page, "--dump-dom")
    assert re.search(r'<body data-images="4" data-images-loaded="4"', dom.stdout), dom.stdout[-500:]
    assert not [line for line in dom.stderr.splitlines() if ":CONSOLE" in line], dom.stderr
    shot = tmp_path / "shot.png"
    _render(browser, page, f"--screenshot={shot}", "--window-size=1280,2400")
    image = matplotlib.image.imread(shot)
    assert image.shape[:2] == (2400, 1280) and image.std() > 0.05  # a page, not a blank


# Records, once the page has laid out, how wide its content is against the window: a page wider
# than the window scrolls sideways (a table or a long path that does not wrap).
MEASURE_WIDTH = ("<script>window.addEventListener('load',function(){var d=document.documentElement;"
                 "document.body.dataset.scrollWidth=d.scrollWidth;document.body.dataset.clientWidth=d.clientWidth;});"
                 "</script>")


def _page_width(browser: str, page: Path, width: int) -> tuple[int, int]:
    """(content width, window width) of the page rendered in a `width`-pixel window."""
    measured = page.with_name("measured.html")
    measured.write_text(page.read_text().replace("</body>", MEASURE_WIDTH + "</body>"))
    dom = _render(browser, measured, "--dump-dom", f"--window-size={width},900")
    found = re.search(r'data-scroll-width="(\d+)" data-client-width="(\d+)"', dom.stdout)
    assert found, dom.stdout[-500:]
    return int(found.group(1)), int(found.group(2))


def test_the_html_report_fits_a_1280_pixel_window(tmp_path: Path) -> None:
    """Wide tables scroll inside themselves, long paths and labels wrap: the page never scrolls
    sideways (issue 65), here with a long run path and a long label in every table."""
    browser = _browser()
    runs = tmp_path / ("runs-" + "x" * 150)
    shutil.copytree(GOLDEN, runs)
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["report", str(runs), "-o", str(out), "--html", "--title", "t" * 300])
    assert result.exit_code == 0, result.output
    content, window = _page_width(browser, out / "report.html", 1280)
    assert 1240 <= window <= 1280 and content <= window, (content, window)  # (the window less a scrollbar)


def test_the_width_check_sees_a_page_wider_than_its_window(tmp_path: Path) -> None:
    page = tmp_path / "wide.html"
    page.write_text('<html><body><div style="width:3000px">wide</div></body></html>')
    content, window = _page_width(_browser(), page, 1280)
    assert content > window


def test_a_page_that_fails_to_load_an_image_is_seen(tmp_path: Path) -> None:
    """The check can fail: an image that does not decode and a script error show in the browser."""
    browser = _browser()
    page = tmp_path / "bad.html"
    page.write_text('<html><body><img src="missing.png"><script>undefinedFn();</script>'
                    "<script>window.addEventListener('load',function(){var i=document.images,n=0;for(var k=0;"
                    "k<i.length;k++){if(i[k].naturalWidth>0){n++;}}document.body.dataset.imagesLoaded=n;});</script>"
                    "</body></html>")
    dom = _render(browser, page, "--dump-dom")
    assert 'data-images-loaded="0"' in dom.stdout
    assert any(":CONSOLE" in line and "undefinedFn" in line for line in dom.stderr.splitlines())


def test_provenance_names_an_embedded_model_as_any_machine_resolves_it() -> None:
    from kvbench.analysis.html_report import provenance
    from kvbench.analysis.runs import Run
    from kvbench.model.resolve import resolve_model

    path = resolve_model(None)  # the shipped model: a path of this checkout
    interpreter = str(Path(path).parent / ".venv" / "bin" / "python")  # a checkout's own interpreter: its path too
    run = Run(Path("r"), {"config": {"model": path, "server_command": [interpreter, "--model", path, "--port", "1"]}},
              pd.DataFrame())
    shown = provenance(run)
    assert shown["model"] == "kvbench:recall-v1"
    assert shown["server_command"] == ["python", "--model", "kvbench:recall-v1", "--port", "1"]


def _hostile_runs(tmp_path: Path, port: int) -> Path:
    """The golden runs under a folder, a label and a trace generator's workflow that each plant a
    Markdown image pointing at a local server, and a `|` that would add a table column."""
    import json

    runs = tmp_path / f"runs ![f](http://127.0.0.1:{port}/folder.png)"
    shutil.copytree(GOLDEN, runs)
    for name in ("fullshared", "nonshared"):
        for file in ("summary.json", "config.json"):
            data = json.loads((runs / name / file).read_text())
            config = data.get("config", data)
            for holder in (data, config):
                holder["label"] = f"{name}|x ![l](http://127.0.0.1:{port}/label.png)"
            config["trace_header"]["generator"]["workflow"] = f"seq ![w](http://127.0.0.1:{port}/workflow.png)"
            (runs / name / file).write_text(json.dumps(data))
    return runs


def test_a_report_fetches_nothing_and_keeps_its_columns_whatever_a_run_holds(tmp_path: Path) -> None:
    """Issue 66: URLs planted in a label, a workflow and a folder's name were fetched when the page
    opened, and a `|` in a label shifted a row by one column."""
    import http.server
    import threading

    browser = _browser()
    fetched: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fetched.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        runs = _hostile_runs(tmp_path, server.server_address[1])
        out = tmp_path / "report"
        result = CliRunner().invoke(main, ["report", str(runs), "-o", str(out), "--html",
                                           "--title", f"t ![t](http://127.0.0.1:{server.server_address[1]}/title.png)"])
        assert result.exit_code == 0, result.output
        dom = _render(browser, out / "report.html", "--dump-dom")
        assert re.search(r'data-images="4" data-images-loaded="4"', dom.stdout)  # the plots only
    finally:
        server.shutdown()
    assert fetched == []
    markdown = (out / "report.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| run") and "completed" in line)
    row = next(line for line in markdown.splitlines() if line.startswith("| fullshared\\|x"))
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")],
                     [c.strip() for c in re.split(r"(?<!\\)\|", row.strip("|"))]))
    assert cells["completed"] == "24" and cells["failed"] == "0", cells


def test_a_report_into_a_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from kvbench.analysis import plots

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plots, "memory_plot", full)  # the disk fills halfway through the report
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["report", str(GOLDEN), "-o", str(out), "--html"])
    assert result.exit_code == 1 and "No space left on device" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback
    assert list(out.iterdir()) == [] and [p.name for p in tmp_path.iterdir()] == ["report"]


def test_named_agents_are_reported_in_workflow_order(tmp_path: Path) -> None:
    """An imported chat log's agents have names (`planner`, `coder`): every table and plot takes
    them (kvbench's own A0, A1, ... by number), in the order of their first turns."""
    import pandas as pd

    runs = tmp_path / "runs"
    shutil.copytree(GOLDEN, runs)
    names = {"A0": "planner", "A1": "coder", "A2": "reviewer", "A3": "A10"}
    for run in runs.iterdir():
        requests = pd.read_parquet(run / "requests.parquet")
        requests["agent"] = requests["agent"].map(names)
        requests.to_parquet(run / "requests.parquet")
        (run / "requests.jsonl").unlink()
    result = CliRunner().invoke(main, ["report", str(runs), "-o", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    by_agent = pd.read_csv(tmp_path / "report" / "ttft_by_agent.csv", index_col=0)
    assert list(by_agent.index) == ["A10", "planner", "coder", "reviewer"]
