"""SIGINT and SIGTERM as a clean stop: what `timeout`, CI runners, schedulers and container stops
send. The default action of SIGTERM kills Python at once, so no `finally` runs, no summary is
written and a server kvbench started is left behind; kvbench turns both signals into an
`Interrupted` exception (or, inside a replay's event loop, into a cancellation it can record)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A stop signal ended the command. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` swallows it; the process exits with 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def on_stop_signals(handler: Callable[[int], None]) -> Iterator[None]:
    """Call `handler(signum)` on SIGINT or SIGTERM while the block runs; the previous handlers
    come back afterwards. Outside the main thread (where Python cannot take signals) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, _: FrameType | None) -> None:
        handler(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def raise_interrupted(signum: int) -> None:
    raise Interrupted(signum)


def raise_on_stop_signals() -> contextlib.AbstractContextManager[None]:
    """Turn SIGINT and SIGTERM into `Interrupted` in the main thread while the block runs, so
    that context managers (a started server's) clean up on the way out."""
    return on_stop_signals(raise_interrupted)
