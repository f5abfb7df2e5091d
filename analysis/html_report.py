"""`kvbench report --html`: the report as one self-contained HTML file (its tables, its plots
embedded as data URIs, each run's config and provenance), to send to a colleague as one file.

The Markdown report (kvbench.analysis.report) is rendered with markdown-it (CommonMark and its
tables), so both say the same; nothing is fetched when the file is opened.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from kvbench.analysis.runs import Run
from kvbench.model.store import embedded_name

# The page never scrolls sideways (a 1280-pixel window, tested): wide tables scroll inside
# themselves, their cells kept on one line; long paths, labels and titles elsewhere wrap.
STYLE = """body{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;color:#222;
overflow-wrap:anywhere}
table{border-collapse:collapse;margin:1em 0;font-size:13px;display:block;overflow-x:auto;max-width:100%}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:right;white-space:nowrap;overflow-wrap:normal}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;display:block;margin:1em 0}
pre{background:#f7f7f7;padding:1em;overflow-x:auto;font-size:12px}code{background:#f3f3f3}"""
# Nothing is fetched when the page opens, whatever a run's strings hold: images only from the page's
# own data, its own style and script only.
CSP = ('<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
       'style-src \'unsafe-inline\'; script-src \'unsafe-inline\'; base-uri \'none\'; form-action \'none\'">')
# Marks on <body> how many images the browser decoded, once the page has loaded: what a headless
# browser (and the test) checks that every plot arrived.
IMAGES_LOADED = ("<script>window.addEventListener('load',function(){var i=document.images,n=0;"
                 "for(var k=0;k<i.length;k++){if(i[k].complete&&i[k].naturalWidth>0){n++;}}"
                 "document.body.dataset.images=i.length;document.body.dataset.imagesLoaded=n;});</script>")


def provenance(run: Run) -> dict[str, object]:
    """What a reader needs to rerun a run: where it is, what ran, on what, from which commit."""
    config = run.config
    keys = ("run_id", "date", "method", "method_params", "model", "model_identity", "request_rate", "num_trajectories",
            "num_warmups", "prime_method_state", "sampling", "goodput", "kvbench_version", "git_sha", "host",
            "vllm_version", "server_command")
    out: dict[str, object] = {"path": str(run.path), **{key: config.get(key) for key in keys if key in config}}
    model = config.get("model")
    if isinstance(model, str) and (name := embedded_name(model)) != model:
        # an embedded model's path is this machine's cache: name it as any machine resolves it
        out["model"] = name
        if isinstance(out.get("server_command"), list):
            out["server_command"] = [name if arg == model else arg for arg in out["server_command"]]  # type: ignore[union-attr]
    command = out.get("server_command")
    if isinstance(command, list) and command and isinstance(command[0], str) and command[0].endswith("python"):
        out["server_command"] = ["python", *command[1:]]  # the interpreter's path is this machine's checkout
    return out


def write_html_report(markdown_path: Path, runs: list[Run], title: str) -> Path:
    """report.html beside `markdown_path` (the Markdown report and its PNGs, already written)."""
    from markdown_it import MarkdownIt

    out_dir = markdown_path.parent
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown_path.read_text())
    for png in sorted(out_dir.glob("*.png")):
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        body = body.replace(f'src="{png.name}"', f'src="data:image/png;base64,{data}"')
    details = "".join(f"<details><summary><code>{html.escape(str(run.path))}</code></summary><pre>"
                      f"{html.escape(json.dumps(provenance(run), indent=2, default=str))}</pre></details>"
                      for run in runs)
    page = (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">{CSP}<title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}<h2>Runs: configuration and provenance</h2>{details}"
            f"{IMAGES_LOADED}</body></html>\n")
    path = out_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
