"""The child side of `ampdoctor run`: attach a Doctor in a child Python process and leave its report behind.

`install()` runs from the start-up hook (``runner/_startup/sitecustomize.py``). The Doctor attaches right after
the child imports torch (``runner.startup.after_torch_import``), explains an uncaught exception, and at exit writes
``child-<pid>.json`` into ``AMPDOCTOR_CHILD_DIR`` for the parent to merge. A child that trained nothing (a DataLoader
worker, a helper script) writes nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
from typing import Any

from ampdoctor.runner.startup import after_torch_import

ENV_DIR = "AMPDOCTOR_CHILD_DIR"
ENV_OPTIONS = "AMPDOCTOR_CHILD_OPTIONS"


_installed = False


def install() -> None:
    """Attach a Doctor now if torch is already imported, else right after the child imports it.

    Safe to call twice: in a virtualenv ``site`` processes a ``.pth`` file twice.
    """
    global _installed
    if _installed or not os.environ.get(ENV_DIR):
        return
    _installed = True
    after_torch_import(start)


def label() -> str:
    """Return how this process was started, for the parent's report: ``pid 123: python train.py --fast``."""
    argv = " ".join(sys.argv) if sys.argv and sys.argv != [""] else "python"
    if "multiprocessing" in sys.modules and sys.modules["multiprocessing"].parent_process() is not None:
        argv = f"multiprocessing child of pid {os.getppid()}"
    return f"pid {os.getpid()}: {argv[:160]}"


def start() -> None:
    """Attach a Doctor configured by ``AMPDOCTOR_CHILD_OPTIONS`` to this process."""
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return
    from ampdoctor._compat.tqdm import clear_of_bars
    from ampdoctor.core.isolation import call_safely
    from ampdoctor.core.options import RunOptions
    from ampdoctor.ranks.children import rank_name, write_child
    from ampdoctor.runner.attached import chain_excepthook, watched_by
    from ampdoctor.runner.doctor import Doctor

    options = RunOptions.from_dict(json.loads(os.environ.get(ENV_OPTIONS) or "{}"))
    shared_log = options.log_dir
    if shared_log:
        options = options.replace(log_dir=os.path.join(shared_log, f"pid{os.getpid()}"))
    prefix = f"ampdoctor[pid {os.getpid()}]"

    def say(line: str) -> None:   # a rank other than 0 is quiet: rank 0 reports for the job (see merge_ranks)
        if doctor.rank_info is None or doctor.rank_info.rank == 0:
            with clear_of_bars(sys.stderr):   # at column 0, not after an open tqdm bar
                rest = line.removeprefix("ampdoctor")   # "ampdoctor --fix: ..." -> "ampdoctor[pid N] --fix: ..."
                print(f"{prefix}{rest}" if rest != line else f"{prefix} {line}".rstrip(), file=sys.stderr)

    def on_rank(info: Any) -> None:   # a rank of the parent's job: the parent waits for its report, by rank
        write_child(directory, rank_name(os.getpid()), {"rank": info.rank, "world": info.world_size})
        if shared_log:   # its flight recorder is ampdoctor.rank{r}.jsonl next to the other ranks' ones
            doctor.log_dir = shared_log

    doctor = Doctor(options, on_event=say, on_rank=on_rank)
    doctor.attach()
    watched_by("ampdoctor run (a child process)").__enter__()   # for the process's life: attach() does nothing
    chain_excepthook(doctor.explain)
    atexit.register(call_safely, _finish, doctor, directory)
    call_safely(_finish_on_sigterm, doctor, directory)


def _finish_on_sigterm(doctor: Any, directory: str) -> None:
    """Leave the report behind when the parent stops this process with SIGTERM (``torch.multiprocessing.spawn``
    stops the other workers once one failed; ``atexit`` does not run then), then die of the signal as before.
    Only where SIGTERM has its default action: a handler of the script's own is left alone."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        from ampdoctor.core.isolation import call_safely

        call_safely(_finish, doctor, directory)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)   # raises ValueError off the main thread: call_safely drops it


_finished: set[int] = set()


def _finish(doctor: Any, directory: str) -> None:
    from ampdoctor.ranks.children import report_name, write_child

    if id(doctor) in _finished:   # SIGTERM came during atexit, or atexit after SIGTERM's report
        return
    _finished.add(id(doctor))
    doctor.detach()
    report = doctor.report
    if report.saw_nothing and not report.findings:
        return  # a process that trained nothing has nothing to add
    info = doctor.rank_info   # a rank of a job the parent launched itself: merged with the parent's as a rank
    ranked = {"rank": info.rank, "world": info.world_size, "failed_at": doctor.failed_at} if info else {}
    write_child(directory, report_name(os.getpid()), {"process": label(), **ranked, "report": report.to_dict()})

