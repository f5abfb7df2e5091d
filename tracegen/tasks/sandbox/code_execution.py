"""Running HumanEval completions against their tests: model-written code, run only in an OS sandbox.

A completion is untrusted code. Each check runs in two fresh bubblewrap sandboxes
(tracegen/tasks/sandbox/sandboxed_check.py): the *candidate* runs the prompt and the completion and answers calls
to its entry point with plain values; the *tests* run the problem's prompt and test with the entry
point replaced by a proxy that calls the candidate. The completion never runs where the asserts do,
so it cannot rewrite them, forge an exit status or print a result; the outcome is read from the
tests' stdout, which the candidate has no handle to.

Each sandbox: the standard library and the system's libraries read-only (no /etc, /home, /root,
the working tree or any installed package: nothing to read a secret from), a private size-capped
/tmp and /dev/shm, no network
(`--unshare-net`), its own pid, IPC and UTS namespaces (no signal reaches a process outside),
`--die-with-parent` and `--new-session`; rlimits on CPU time, address space, processes, file size
and open files; an unprivileged uid of its own when kvbench runs as root (bubblewrap then drops to
it before the completion runs, so the process limit applies); a seccomp filter that refuses new
namespaces, mounts and anonymous memory files (a user namespace of its own would let a completion
mount a tmpfs no limit sizes, memory the host pays for); a wall deadline after which the whole
sandbox is killed. Results carry only the outcome and a type name, never the completion's
messages or output.

Running model-written code needs consent, as lm-evaluation-harness asks for it: `--allow-code-
execution` on the command or KVBENCH_ALLOW_CODE_EXECUTION=1. What remains is in docs/running.md
(a completion can still pass HumanEval's asserts by returning values that satisfy them in ways
nobody meant; a kernel bug in namespaces is a way out of any sandbox of this kind).
"""

from __future__ import annotations

import functools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

CONSENT_ENV = "KVBENCH_ALLOW_CODE_EXECUTION"
CONSENT_HELP = (f"running model-written code (HumanEval's tests) needs consent: pass --allow-code-execution or set "
                f"{CONSENT_ENV}=1 (it runs in a bubblewrap sandbox: docs/running.md#running-generated-code)")
INSTALL_HELP = ("install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install bubblewrap`; "
                "scripts/install.sh does it as root) and allow unprivileged user namespaces when not running as root")
STARTUP_SLACK_S = 15.0  # two interpreters starting on a loaded machine, beyond the check's own time
SANDBOX_UID_BASE = 3_900_000  # root: one unprivileged uid per worker, far above any account's
_SCRIPT_INSIDE = "/kvbench/sandboxed_check.py"
_ROOT_SHELL_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class CodeExecutionRefused(RuntimeError):
    """No consent to run model-written code, or no working sandbox to run it in."""


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
    result: str  # "passed", "failed: <what>" or "timed out"


@dataclass(frozen=True)
class SandboxLimits:
    """Each sandboxed process's limits. `processes` counts every task of the sandbox's uid (its
    two interpreters included), so a fork bomb stops at it."""

    memory_bytes: int = 512 << 20
    file_size_bytes: int = 16 << 20
    tmp_bytes: int = 16 << 20
    open_files: int = 64
    processes: int = 8


def consent_given() -> bool:
    return os.environ.get(CONSENT_ENV, "").strip().lower() in ("1", "true", "yes")


def require_code_execution() -> None:
    """Refuse, before any work, unless the user consented and a sandbox works here."""
    if not consent_given():
        raise CodeExecutionRefused(CONSENT_HELP)
    problem = sandbox_problem()
    if problem is not None:
        raise CodeExecutionRefused(f"no sandbox to run model-written code in ({problem}): {INSTALL_HELP}")


@functools.cache
def sandbox_problem() -> str | None:
    """Why a sandbox cannot start here, or None: bubblewrap found and a trial run of it works."""
    if shutil.which("bwrap") is None:
        return "bubblewrap's bwrap is not on PATH"
    try:
        program = _seccomp_file()
    except (ImportError, OSError, RuntimeError) as error:  # pyseccomp, or libseccomp.so.2, missing
        return f"no seccomp filter ({error}; pip install pyseccomp, and libseccomp2 from the system)"
    try:
        with program:
            done = subprocess.run(_bwrap_command(SandboxLimits(), "probe", seccomp_fd=program.fileno()),
                                  capture_output=True, text=True, timeout=30, pass_fds=(program.fileno(),),
                                  env=_sandbox_env(SANDBOX_UID_BASE if os.geteuid() == 0 else None))
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bwrap did not run: {error}"
    if done.returncode != 0 or not done.stdout.startswith("sandbox ok"):
        return f"a trial sandbox failed: {(done.stderr or done.stdout).strip()[-300:]}"
    return None


def _python_binds() -> list[str]:
    """The interpreter's own folders, which the sandbox needs to run `python -I -S` (its installed
    packages hidden: _package_dirs)."""
    executable = os.path.realpath(sys.executable)
    folders = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(executable))}
    return sorted(f for f in folders if not (f == "/usr" or f.startswith("/usr/")))


def _package_dirs() -> list[str]:
    """Where the sandbox's interpreter and the system keep installed packages: each covered by an
    empty read-only folder, so only the standard library is readable."""
    import sysconfig

    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    base = {"base": sys.base_prefix, "platbase": sys.base_prefix, "installed_base": sys.base_prefix,
            "installed_platbase": sys.base_prefix}
    places = {sysconfig.get_paths(vars=base)[key] for key in ("purelib", "platlib")}
    places |= {"/usr/lib/python3/dist-packages", f"/usr/local/lib/python{version}/dist-packages",
               f"/usr/local/lib/python{version}/site-packages", f"/usr/lib/python{version}/site-packages"}
    return sorted(os.path.realpath(p) for p in places if os.path.isdir(p))


# Syscalls a completion never needs, each a way past the sandbox's bounds: new namespaces (a user
# namespace's mounts and unsized tmpfs), entering others, mounting, anonymous memory files (memfd:
# shared memory RLIMIT_AS does not count until mapped), and kernel facilities holding memory of
# their own (BPF maps, userfaultfd, keyrings, perf buffers).
_REFUSED_SYSCALLS = ("unshare", "setns", "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen",
                     "fsmount", "fsconfig", "fspick", "mount_setattr", "memfd_create", "memfd_secret", "bpf",
                     "userfaultfd", "perf_event_open", "add_key", "request_key", "keyctl")
# clone(2)'s namespace flags (os has them only from Python 3.12): time, mount, cgroup, UTS, IPC,
# user, pid, net
_CLONE_NAMESPACE_FLAGS = (0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


@functools.cache
def _seccomp_program() -> bytes:
    """The sandbox's seccomp filter as the BPF program bubblewrap loads (`--seccomp FD`): every
    call allowed but the refused ones (EPERM), clone with a namespace flag, and clone3 (ENOSYS:
    its flags lie in memory a filter cannot read; the C library then falls back to clone)."""
    import errno

    import pyseccomp as seccomp

    program = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in _REFUSED_SYSCALLS:
        try:
            program.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (RuntimeError, ValueError, OSError):  # a call this kernel's libseccomp does not know
            continue
    for flag in _CLONE_NAMESPACE_FLAGS:
        program.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    program.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        program.export_bpf(out)
        out.seek(0)
        return out.read()


def _seccomp_file() -> IO[bytes]:
    """A file holding the filter, at its start, for one bwrap to read (it reads to the end)."""
    handle = tempfile.TemporaryFile()
    handle.write(_seccomp_program())
    handle.seek(0)
    return handle


def _bwrap_command(limits: SandboxLimits, *program_args: str, seccomp_fd: int | None = None) -> list[str]:
    """bwrap and its options, then the sandboxed interpreter running sandboxed_check.py (with
    `seccomp_fd`: under that file's filter)."""
    as_root = os.geteuid() == 0
    # the private /tmp first: a folder bound later may lie under it
    command = ["bwrap", "--perms", "1777", "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp", "--ro-bind", "/usr", "/usr"]
    for link in _ROOT_SHELL_LINKS:
        if os.path.islink(link):
            command += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            command += ["--ro-bind", link, link]
    command += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    made: set[str] = set()
    for folder in _python_binds():
        # parents made world-traversable: bubblewrap copies the source's modes (a root-only /root)
        for parent in reversed(Path(folder).parents):
            if str(parent) not in ("/", "/tmp") and str(parent) not in made and not str(parent).startswith("/usr"):
                command += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        command += ["--ro-bind", folder, folder]
    for packages in _package_dirs():  # an empty read-only folder over each
        command += ["--perms", "0555", "--size", "4096", "--tmpfs", packages, "--remount-ro", packages]
    command += ["--ro-bind", str(Path(__file__).with_name("sandboxed_check.py")), _SCRIPT_INSIDE,
                "--dev", "/dev", "--perms", "1777", "--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm",
                "--proc", "/proc", "--chdir", "/tmp", "--die-with-parent", "--new-session"]
    if seccomp_fd is not None:
        command += ["--seccomp", str(seccomp_fd)]
    if as_root:
        # No user namespace: the sandbox's root drops to an unprivileged uid (sandboxed_check.py)
        # before any completion runs, the one capability it keeps being the switch itself.
        command += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                    "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        command += ["--unshare-all"]
    python = os.path.realpath(sys.executable)
    return command + [python, "-I", "-S", "-B", _SCRIPT_INSIDE, *program_args]


def _sandbox_env(uid: int | None) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    if uid is not None:
        env["KVBENCH_SANDBOX_UID"] = str(uid)
    return env


def _own_tasks() -> int:
    """Processes and threads of this uid now: RLIMIT_NPROC counts them all when not root."""
    uid, count = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue
    return count


def _limiter(limits: SandboxLimits, cpu_s: int, processes: int) -> Callable[[], None]:
    def apply() -> None:  # runs in the child between fork and exec: bwrap and all inside inherit it
        import resource

        for which, value in ((resource.RLIMIT_AS, limits.memory_bytes), (resource.RLIMIT_FSIZE, limits.file_size_bytes),
                             (resource.RLIMIT_NOFILE, limits.open_files), (resource.RLIMIT_CPU, cpu_s),
                             (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_CORE, 0)):
            _soft, hard = resource.getrlimit(which)
            resource.setrlimit(which, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))
    return apply


def _kill(process: subprocess.Popen[bytes]) -> None:
    """The sandbox's whole session: bwrap, and with it (--die-with-parent) its pid namespace."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _check_one(check: CodeCheck, timeout_s: float, limits: SandboxLimits, uid: int | None, processes: int) -> CheckResult:
    calls_read, calls_write = os.pipe()
    answers_read, answers_write = os.pipe()
    cpu_s = int(timeout_s) + 5
    env = _sandbox_env(uid)
    with tempfile.TemporaryFile() as candidate_errors, _seccomp_file() as candidate_filter, \
            _seccomp_file() as tests_filter:
        try:
            candidate = subprocess.Popen(_bwrap_command(limits, "candidate", seccomp_fd=candidate_filter.fileno()),
                                         stdin=calls_read, stdout=answers_write, stderr=candidate_errors, env=env,
                                         start_new_session=True, pass_fds=(candidate_filter.fileno(),),
                                         preexec_fn=_limiter(limits, cpu_s, processes))
            try:
                tests = subprocess.Popen(_bwrap_command(limits, "tests", seccomp_fd=tests_filter.fileno()),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=env, start_new_session=True,
                                         pass_fds=(calls_write, answers_read, tests_filter.fileno()),
                                         preexec_fn=_limiter(limits, cpu_s, processes))
            except BaseException:
                _kill(candidate)
                raise
        finally:
            for fd in (calls_read, calls_write, answers_read, answers_write):
                os.close(fd)  # each end now lives only in the sandbox that uses it
        job = {"program": check.prompt + check.completion, "prompt": check.prompt, "test": check.test,
               "entry_point": check.entry_point, "timeout_s": timeout_s, "calls_fd": calls_write,
               "answers_fd": answers_read}
        try:
            out, err = tests.communicate(json.dumps(job).encode(), timeout=timeout_s + STARTUP_SLACK_S)
        except subprocess.TimeoutExpired:
            _kill(tests)
            _kill(candidate)
            return CheckResult(check.task_id, False, "timed out")
        _kill(candidate)
        candidate_errors.seek(0)
        candidate_stderr = candidate_errors.read(2000).decode(errors="replace")
    lines = out.decode(errors="replace").strip().splitlines()
    outcome = _parse_outcome(lines[-1] if lines else "")
    if outcome is None or candidate_stderr.startswith("bwrap:"):
        # the sandbox itself failed (not the completion): a scoring error, never a silent "failed"
        reason = candidate_stderr.strip() or err.decode(errors="replace").strip() or f"exit {tests.returncode}"
        raise RuntimeError(f"the HumanEval sandbox failed for {check.task_id}: {reason[-500:]}")
    passed, result = outcome
    return CheckResult(check.task_id, passed, result)


def _parse_outcome(line: str) -> tuple[bool, str] | None:
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not (isinstance(data, dict) and isinstance(data.get("passed"), bool) and isinstance(data.get("result"), str)):
        return None
    return data["passed"], data["result"][:200]


def check_completions(checks: Sequence[CodeCheck], timeout_s: float = 3.0, workers: int | None = None,
                      limits: SandboxLimits | None = None) -> list[CheckResult]:
    """Run every check in its own pair of sandboxes (see the module's docstring); results in order.
    Raises CodeExecutionRefused without consent or a working sandbox."""
    if not checks:
        return []
    require_code_execution()
    limits = limits or SandboxLimits()
    workers = max(1, workers or min(4, os.cpu_count() or 1))
    as_root = os.geteuid() == 0
    # As root each worker has a uid of its own, so a fork bomb exhausts only its own check's limit.
    # Otherwise every task of this user counts: those running now, the pool's threads and, per
    # worker, two sandboxes of three tasks each (bwrap, its init, the interpreter) and their share.
    processes = limits.processes if as_root else _own_tasks() + workers * (1 + 6 + limits.processes)

    free: queue.Queue[int] = queue.Queue()
    for slot in range(workers):
        free.put(slot)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        def run(check: CodeCheck) -> CheckResult:
            slot = free.get()
            try:
                uid = SANDBOX_UID_BASE + slot if as_root else None
                return _check_one(check, timeout_s, limits, uid, processes)
            finally:
                free.put(slot)

        return list(pool.map(run, checks))
