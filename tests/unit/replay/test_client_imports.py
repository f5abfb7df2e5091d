"""A replay client (`kvbench replay --base-url URL`) is an HTTP client: it imports neither torch
nor vLLM (nor transformers, whose tokenizers pull torch in). Checked in a fresh process, after a
whole replay against the stand-in server, so that a lazy import on any path it took counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvbench.replay.stub import StubServer

HEAVY = ["torch", "vllm", "transformers", "triton"]
CLIENT = """
import json, sys
from kvbench.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    print("LOADED " + json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(%r))))
"""


def _client(args: list[str]) -> tuple[list[str], subprocess.CompletedProcess]:
    done = subprocess.run([sys.executable, "-c", CLIENT % HEAVY, *args], capture_output=True, text=True, check=False)
    loaded = [line for line in done.stdout.splitlines() if line.startswith("LOADED ")]
    assert loaded, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(loaded[-1].removeprefix("LOADED ")), done


def test_a_replay_client_imports_neither_torch_nor_vllm(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    with StubServer(connector=True, connector_method="kvcmas") as stub:
        loaded, done = _client(["replay", "--method", "kvcmas", "--base-url", stub.base_url, "--model",
                                str(tiny_tokenizer_dir), "--qps", "0", "--num-trajectories", "2", "--shared-tokens",
                                "64", "--output-len", "4", "--result-dir", str(tmp_path / "run")])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").is_file()  # the replay ran to its end
    assert loaded == []


def test_the_check_sees_a_heavy_import(tmp_path: Path) -> None:
    """The probe itself: a command that imports torch is caught (`kvbench methods` does not, but a
    method's implementation does)."""
    loaded, _ = _client(["methods"])
    assert loaded == []
    probe = tmp_path / "probe.py"
    probe.write_text("from kvbench.methods.registry import method_class\nmethod_class('fullshared')\n")
    done = subprocess.run([sys.executable, "-c", f"exec(open({str(probe)!r}).read()); import sys; "
                           "print('torch' in sys.modules)"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"
