"""One writer per result folder: an exclusive lock held for a whole run (replay, resume, sweep).

Two replays writing one folder interleave their journals and summaries into data that looks
complete and is wrong, so the second is refused at once, naming the holder. The lock is an
advisory `flock` on `.kvbench.lock` in the folder: the kernel drops it when its holder dies,
so a lock file left by a killed run is taken over (with a note), never waited on. The file
keeps the holder's PID, start time and command for the message; it is emptied on release.
Re-entrant within one process (the CLI takes it before starting a server, the replay again).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

LOCK_NAME = ".kvbench.lock"


class ResultDirError(RuntimeError):
    """The result folder cannot be written, or another run holds it."""


_held: dict[Path, tuple[int, IO[str]]] = {}  # folder -> (depth, open lock file) held by this process
_guard = threading.Lock()


def _holder_text(holder: dict[str, Any]) -> str:
    command = holder.get("command")
    return (f"PID {holder.get('pid', '?')} (started {holder.get('started', '?')}"
            + (f": {command}" if command else "") + ")")


def _read_holder(handle: IO[str]) -> dict[str, Any]:
    handle.seek(0)
    text = handle.read().strip()
    if not text:
        return {}
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return {"pid": "?", "started": "?", "command": "unreadable lock file"}
    return holder if isinstance(holder, dict) else {}


def _open(result_dir: Path) -> IO[str]:
    """The folder (created if needed) and its lock file, opened for writing; a folder that cannot
    be written is one clear error naming it."""
    try:
        result_dir.mkdir(parents=True, exist_ok=True)
        return open(result_dir / LOCK_NAME, "a+", encoding="utf-8")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ResultDirError(f"cannot write to the result folder {result_dir}: {reason}") from None


@contextlib.contextmanager
def result_dir_lock(result_dir: Path, on_note: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold `result_dir` for this process; ResultDirError when another live process holds it or
    the folder cannot be written. `on_note(text)` hears that a dead holder's lock was taken over."""
    key = result_dir.resolve()
    with _guard:
        if key in _held:
            depth, handle = _held[key]
            _held[key] = (depth + 1, handle)
        else:
            handle = _open(result_dir)
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(handle)
                handle.close()
                raise ResultDirError(f"{result_dir} is in use by another kvbench run, {_holder_text(holder)}: wait "
                                     "for it to end or choose another --result-dir") from None
            previous = _read_holder(handle)
            if previous and on_note is not None:
                on_note(f"{result_dir}: took over the lock of {_holder_text(previous)}, which is no longer running")
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps({"pid": os.getpid(), "started": datetime.now(UTC).isoformat(timespec="seconds"),
                                     "command": " ".join(sys.argv)[:300]}))
            handle.flush()
            _held[key] = (1, handle)
    try:
        yield
    finally:
        with _guard:
            depth, handle = _held[key]
            if depth > 1:
                _held[key] = (depth - 1, handle)
            else:
                del _held[key]
                with contextlib.suppress(OSError):
                    handle.seek(0)
                    handle.truncate()  # released cleanly: the next run sees no stale holder
                handle.close()  # closing drops the flock
