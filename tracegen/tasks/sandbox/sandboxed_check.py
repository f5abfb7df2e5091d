"""The two programs of one HumanEval check, each run by tracegen/tasks/sandbox/code_execution.py in its own
bubblewrap sandbox with `python -I -S` (the standard library only: this file imports nothing else).

`candidate`: runs the model's program (the problem's prompt and the completion) and answers calls
to its entry point, one JSON line per call, on the pipes it was started with. Only values go back
(plain literals: numbers, strings, bytes, lists, tuples, dicts, sets, None), never objects.

`tests`: runs the problem's own prompt and test with the entry point replaced by a proxy that
calls the candidate through those pipes, and writes the outcome on its stdout, which only the
scorer reads. The completion never runs in this process, so it cannot reach the test's asserts,
rewrite them, fake an exit status or print a result: whatever it does, it only ever returns values.
"""

from __future__ import annotations

import json
import os
import re
import select
import sys
import time
from typing import Any

MAX_MESSAGE_BYTES = 1 << 20  # a call's arguments or a value, encoded
_TYPE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,63}")


class Unsendable(Exception):
    """A value that is not a plain literal (the check compares values, never objects)."""


def encode(value: Any, depth: int = 0) -> Any:
    """A JSON-ready form that keeps Python's literal types apart (a tuple is not a list)."""
    if depth > 100:
        raise Unsendable("nested deeper than 100")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"tuple": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind in (set, frozenset):
        return {kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    raise Unsendable(f"a value of type {_type_name(value)}")


def decode(data: Any) -> Any:
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) != 1:
        raise Unsendable("a malformed value")
    (tag, items), = data.items()
    if tag == "tuple":
        return tuple(decode(v) for v in items)
    if tag == "dict":
        return {decode(k): decode(v) for k, v in items}
    if tag == "set":
        return {decode(v) for v in items}
    if tag == "frozenset":
        return frozenset(decode(v) for v in items)
    if tag == "bytes":
        return bytes.fromhex(items)
    if tag == "complex":
        return complex(items[0], items[1])
    raise Unsendable(f"an unknown tag {tag[:20]!r}")


def _type_name(value: Any) -> str:
    """An exception's or value's type name, or a neutral word when the name is not a plain
    identifier (a class can be named with any string, a file's contents included)."""
    name = getattr(type(value), "__name__", "")
    return name if isinstance(name, str) and _TYPE_NAME.fullmatch(name) else "an object"


def _send(fd: int, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode() + b"\n"
    if len(data) > MAX_MESSAGE_BYTES:
        raise Unsendable(f"a message of {len(data)} bytes")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Lines:
    """Reads newline-ended messages from a pipe, each under MAX_MESSAGE_BYTES, by a deadline."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer = fd, b""

    def read(self, deadline: float | None) -> dict[str, Any] | None:
        """The next message; None at end of file; TimeoutError past `deadline`."""
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_MESSAGE_BYTES:
                raise Unsendable("a message over the size limit")
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                    raise TimeoutError
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        message = json.loads(line)
        if not isinstance(message, dict):
            raise Unsendable("a message that is not an object")
        return message


def _private_pipes() -> tuple[int, int]:
    """The call pipes moved off fds 0 and 1, and 0-2 pointed at /dev/null: what the program
    prints goes nowhere and it reads nothing it was not sent as an argument."""
    calls, answers = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    return calls, answers


def _drop_privileges() -> None:
    """Started as root (bubblewrap as root, with CAP_SETUID/CAP_SETGID only), become the
    unprivileged uid the scorer chose, so the process limit (RLIMIT_NPROC) applies."""
    uid = os.environ.get("KVBENCH_SANDBOX_UID")
    if uid is not None and os.getuid() == 0:
        os.setgroups([])
        os.setgid(int(uid))
        os.setuid(int(uid))


def run_candidate() -> None:
    _drop_privileges()
    calls, answers = _private_pipes()
    source = Lines(calls)
    job = source.read(None)
    if job is None:
        return
    namespace: dict[str, Any] = {"__name__": "__candidate__"}
    try:
        exec(compile(job["program"], "<completion>", "exec"), namespace)
        entry = namespace[job["entry_point"]]
        if not callable(entry):
            raise TypeError
    except BaseException as error:  # noqa: BLE001 - the program's own failure is the answer
        _send(answers, {"loaded": False, "raised": _type_name(error)})
        return
    _send(answers, {"loaded": True})
    while (call := source.read(None)) is not None:
        try:
            value = entry(*decode(call["args"]), **decode(call["kwargs"]))
            reply: dict[str, Any] = {"value": encode(value)}
        except Unsendable as error:
            reply = {"unsendable": str(error)}
        except BaseException as error:  # noqa: BLE001 - returned to the test as a raised exception
            reply = {"raised": _type_name(error)}
        _send(answers, reply)


class CandidateRaised(Exception):
    """The completion raised (its type's name only: never its message, which it wrote)."""


class CandidateBroke(Exception):
    """The completion did not answer a call: it exited, closed its pipe or sent garbage."""


def run_tests() -> None:
    _drop_privileges()
    job = json.loads(sys.stdin.read(MAX_MESSAGE_BYTES * 4))
    calls, answers = job["calls_fd"], job["answers_fd"]  # the pipes to the candidate's sandbox
    deadline = time.monotonic() + job["timeout_s"]
    replies = Lines(answers)

    def outcome(passed: bool, result: str) -> None:
        sys.stdout.write(json.dumps({"passed": passed, "result": result[:200]}) + "\n")
        sys.stdout.flush()

    def answer() -> dict[str, Any]:
        try:
            reply = replies.read(deadline)
        except (Unsendable, ValueError) as error:
            raise CandidateBroke(f"sent a malformed answer ({str(error)[:60]})") from None
        if reply is None:
            raise CandidateBroke("exited without answering")
        return reply

    def candidate(*args: Any, **kwargs: Any) -> Any:
        _send(calls, {"args": encode(list(args)), "kwargs": encode(kwargs)})
        reply = answer()
        if "raised" in reply:
            raise CandidateRaised(str(reply["raised"])[:64])
        if "unsendable" in reply:
            raise CandidateBroke(f"returned {str(reply['unsendable'])[:80]}, which the check cannot compare")
        try:
            return decode(reply["value"])
        except (KeyError, Unsendable, TypeError, ValueError):
            raise CandidateBroke("sent a malformed answer") from None

    try:
        _send(calls, {"program": job["program"], "entry_point": job["entry_point"]})
        loaded = answer()
        if not loaded.get("loaded"):
            return outcome(False, f"failed: the completion did not load ({str(loaded.get('raised'))[:64]})")
        namespace: dict[str, Any] = {"__name__": "__check__"}
        exec(compile(job["prompt"], "<prompt>", "exec"), namespace)
        namespace[job["entry_point"]] = candidate
        exec(compile(job["test"], "<test>", "exec"), namespace)
        namespace["check"](candidate)
    except TimeoutError:
        return outcome(False, "timed out")
    except CandidateRaised as error:
        return outcome(False, f"failed: the completion raised {error}")
    except CandidateBroke as error:
        return outcome(False, f"failed: the completion {error}")
    except AssertionError:
        return outcome(False, "failed: AssertionError")
    except BrokenPipeError:
        return outcome(False, "failed: the completion exited without answering")
    except BaseException as error:  # noqa: BLE001 - the test's own exception is a failure
        return outcome(False, f"failed: {_type_name(error)}")
    outcome(True, "passed")


def run_probe() -> None:
    """The scorer's trial run: the sandbox starts and drops to its uid."""
    _drop_privileges()
    sys.stdout.write(f"sandbox ok uid={os.getuid()}\n")


if __name__ == "__main__":
    {"candidate": run_candidate, "tests": run_tests, "probe": run_probe}[sys.argv[1]]()
