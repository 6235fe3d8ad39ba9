"""Stopping a long command cleanly: SIGINT/SIGTERM, the phase it landed in, progress.

``bench`` and ``verify`` run for minutes. A Ctrl-C (or ``timeout``'s SIGTERM) must stop
them within a second or two, keep what was measured, say where the run was cut, and
exit non-zero: 130 for SIGINT, 143 for SIGTERM (128 + the signal number, what a shell
reports for a process the signal killed), so a script tells a cut run from a complete
one. :func:`interrupts_raise` turns both signals into :class:`Interrupted` (a
``BaseException``: the ``except Exception`` clauses that keep one failing path from
ending a run must not swallow it) and the command writes its partial files.

:class:`PhaseTracker` records where the command is (the interrupt message names it)
and prints a line on stderr when a phase starts and when nothing was printed for
:data:`HEARTBEAT_SECONDS`, so no stretch of a run is silent for longer than that.

Testing aid: ``TRITON_OFFLOAD_SIGNAL_AT=PHASE[@N][/SIGTERM]`` makes the command signal
itself when it enters ``PHASE`` for the ``N``-th time (default 1; SIGINT unless
``/SIGTERM``): a test interrupts each phase at a known point without timing it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TextIO

__all__ = [
    "HEARTBEAT_SECONDS",
    "SIGNAL_AT_ENV",
    "Interrupted",
    "PhaseTracker",
    "ignore_further",
    "interrupts_raise",
]

#: Environment variable of the testing aid described in the module docstring.
SIGNAL_AT_ENV = "TRITON_OFFLOAD_SIGNAL_AT"
#: Longest stretch without a line on stderr: a user watching a shared, loaded machine
#: tells "slow" from "hung" by it.
HEARTBEAT_SECONDS = 10.0

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; ``exit_status`` is what the command returns."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def ignore_further() -> None:
    """Ignore SIGINT/SIGTERM from now on: the command only writes what it has and
    exits, and a second Ctrl-C must not cut the partial file in half (or print a
    traceback). Main thread only; elsewhere a no-op."""
    if threading.current_thread() is threading.main_thread():
        for number in _SIGNALS:
            signal.signal(number, signal.SIG_IGN)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    del frame
    ignore_further()
    raise Interrupted(signum)


@contextmanager
def interrupts_raise() -> Iterator[None]:
    """Inside: SIGINT and SIGTERM raise :class:`Interrupted`; the previous handlers come
    back on exit. Only the main thread may install handlers; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.getsignal(number) for number in _SIGNALS}
    for number in _SIGNALS:
        signal.signal(number, _raise_interrupted)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _parse_signal_at(text: str) -> tuple[str, int, int] | None:
    """``"interpreted@2/SIGTERM"`` -> ``("interpreted", 2, SIGTERM)``; None if empty."""
    text = text.strip()
    if not text:
        return None
    signum = signal.SIGINT
    if "/" in text:
        text, name = text.split("/", 1)
        signum = signal.Signals[name.strip().upper()]
    count = 1
    if "@" in text:
        text, number = text.split("@", 1)
        count = int(number)
    return text.strip(), count, int(signum)


class PhaseTracker:
    """Where a long command is, for its interrupt message and its progress lines.

    ``enter(phase, detail)`` is called at every step (a case, a path, a scenario);
    a line is printed when the phase changes. A daemon thread prints a heartbeat line
    when :data:`HEARTBEAT_SECONDS` pass without a step.
    """

    def __init__(
        self,
        command: str,
        *,
        stream: TextIO | None = None,
        progress: bool = True,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        self.progress = progress
        self.labels = labels or {}
        self.phase = "start-up"
        self.detail = ""
        self._counts: dict[str, int] = {}
        self._started = time.monotonic()
        self._last_line = self._started
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._signal_at = _parse_signal_at(os.environ.get(SIGNAL_AT_ENV, ""))

    def label(self, phase: str | None = None) -> str:
        phase = self.phase if phase is None else phase
        return self.labels.get(phase, phase)

    def where(self) -> str:
        """``'the timed cases (llama3.1-8b-tp4, dma)'``: the phase and its current step."""
        return self.label() + (f" ({self.detail})" if self.detail else "")

    def enter(self, phase: str, detail: str = "", *, line: str | None = None) -> None:
        """Record the step; print the phase's line when the phase changes, and
        ``line`` when given (a step long enough to be announced on its own: one of
        verify's scenarios takes seconds under the Triton interpreter, and a run of them
        printed nothing for a minute, each step resetting the heartbeat)."""
        changed = phase != self.phase
        with self._lock:
            self.phase, self.detail = phase, detail
            self._last_line = time.monotonic()
        if changed and self.progress:
            self._write(f"{self.command}: {self.label(phase)}")
        if line is not None and self.progress:
            self._write(f"{self.command}: {line}")
        self._counts[phase] = self._counts.get(phase, 0) + 1
        if self._signal_at is not None:
            target, count, signum = self._signal_at
            if target == phase and self._counts[phase] == count:
                os.kill(os.getpid(), signum)
                # The handler runs at the next bytecode; give it one for certain here
                # so the phase is cut at this step, not a step later.
                time.sleep(0)

    def _write(self, line: str) -> None:
        elapsed = time.monotonic() - self._started
        try:
            self.stream.write(f"{line} [{elapsed:.0f} s]\n")
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed (a pipe reader went away)
            pass

    def beat_if_quiet(self, now: float) -> bool:
        """Print the heartbeat line if nothing was printed for :data:`HEARTBEAT_SECONDS`
        before ``now`` (a ``time.monotonic()`` value); whether it printed."""
        with self._lock:
            if now - self._last_line < HEARTBEAT_SECONDS:
                return False
            self._last_line = now
            where = self.where()
        self._write(f"{self.command}: still in {where}")
        return True

    def _beat(self) -> None:
        while not self._stop.wait(1.0):
            self.beat_if_quiet(time.monotonic())

    @contextmanager
    def heartbeat(self) -> Iterator[None]:
        """Inside: a line on stderr after every quiet :data:`HEARTBEAT_SECONDS`."""
        if not self.progress:
            yield
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="progress", daemon=True)
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join(timeout=2.0)
