"""The end of a run on SIGTERM, the signal schedulers send (Slurm preemption, Kubernetes, torchrun's agent).

Without ampdoctor a SIGTERM ends the process at once (exit status 143), so a run that is stopped would leave no
report. With a `Termination` installed, the first SIGTERM ends the run as a normal exit does (the report, the
JSON, the flight recorder's end line), then the signal is delivered again with its default action, so the process
ends exactly as it would have: killed by SIGTERM. The script's own handling is never changed: a handler is
installed only where SIGTERM has its default action (not where the script or a framework set one), in the main
thread, and a handler the script installs later replaces it.

While the run is already ending (the script returned or raised), a SIGTERM only cuts ampdoctor's waits short (for
the other ranks' reports); the end goes on, and the signal is delivered again when it is done.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator

__all__ = ["Termination"]


class Termination:
    """End the run on SIGTERM as on a normal exit, then die of the signal as without ampdoctor.

    Args:
        end: ends the run now (called at most once, from the signal handler, in the main thread).

    >>> t = Termination(lambda: None)
    >>> t.received, t.install() in (True, False)
    (False, True)
    >>> t.release()
    """

    def __init__(self, end: Callable[[], Any]) -> None:
        self.end = end
        self.received = False   # a SIGTERM came
        self.ending = False     # the run's end has begun: a SIGTERM now only stops the waits
        self._previous: Any = None
        self._installed = False

    def install(self) -> bool:
        """Catch SIGTERM from now on where it has its default action; return whether it is caught."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return self._installed
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return False   # the script's or a framework's own handler: theirs
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        except (ValueError, OSError, AttributeError):   # no SIGTERM here, or not allowed
            return False
        self._installed = True
        return True

    def begin_end(self) -> None:
        """The run ends now: from here a SIGTERM only stops the waits (catch it here too, if it was not caught)."""
        self.ending = True
        self.install()

    @contextlib.contextmanager
    def closing(self) -> Iterator[None]:
        """The run's end, in a ``with`` block: `begin_end` before it, `release` after it, whatever happens."""
        self.begin_end()
        try:
            yield
        finally:
            self.release()   # a SIGTERM that came while the run ended is delivered now

    def stopped(self) -> bool:
        """Whether a SIGTERM came: the job is being stopped, and waits end."""
        return self.received

    def release(self) -> None:
        """Put back the handler that was there; if a SIGTERM came while the run was ending, deliver it now."""
        if not self._installed:
            return
        self._installed = False
        try:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:   # not replaced by the script since
                signal.signal(signal.SIGTERM, self._previous)
        except (ValueError, OSError):
            return
        if self.received:
            _deliver()   # to the handler put back: SIGTERM's default action, which ends the process (143)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.received = True
        if self.ending:
            return   # the end is under way: it finishes, then release() delivers the signal
        self.ending = True
        try:
            self.end()
        except BaseException:   # nothing of ours may keep the process from ending as it was told
            pass
        self._installed = False
        signal.signal(signal.SIGTERM, self._previous)   # SIGTERM's default action: ours was installed over it
        _deliver()


def _deliver() -> None:
    """Send SIGTERM to this process again, after what was printed has reached the log; with the default action it
    ends the process with exit status 143, as without ampdoctor."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os.kill(os.getpid(), signal.SIGTERM)
