"""The child side of `ampdoctor run`: attach a Doctor in a child Python process and leave its report behind.

`install()` runs from the start-up hook (``runner/_startup/sitecustomize.py``). The Doctor attaches right after
the child imports torch, explains an uncaught exception, and at exit writes ``child-<pid>.json`` into
``AMPDOCTOR_CHILD_DIR`` for the parent to merge. A child that trained nothing (a DataLoader worker, a helper
script) writes nothing.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import traceback
from typing import Any

ENV_DIR = "AMPDOCTOR_CHILD_DIR"
ENV_OPTIONS = "AMPDOCTOR_CHILD_OPTIONS"


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Call ``start()`` once ``import torch`` has finished executing torch's package."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, exec_module = spec.loader, spec.loader.exec_module

        def exec_then_start(module: Any) -> None:
            exec_module(module)
            start()

        loader.exec_module = exec_then_start  # type: ignore[method-assign]
        return spec


_installed = False


def install() -> None:
    """Attach a Doctor now if torch is already imported, else right after the child imports it.

    Safe to call twice: in a virtualenv ``site`` processes a ``.pth`` file twice.
    """
    global _installed
    if _installed or not os.environ.get(ENV_DIR):
        return
    _installed = True
    if "torch" in sys.modules:
        start()
    else:
        sys.meta_path.insert(0, _AfterTorchImport())


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
    from ampdoctor.core.callsite import without_own_frames
    from ampdoctor.core.isolation import call_safely
    from ampdoctor.ranks.children import rank_name, write_child
    from ampdoctor.runner.doctor import Doctor

    options = json.loads(os.environ.get(ENV_OPTIONS) or "{}")
    shared_log = options.get("log_dir")
    if shared_log:
        options["log_dir"] = os.path.join(shared_log, f"pid{os.getpid()}")
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

    doctor = Doctor(**options, on_event=say, on_rank=on_rank)
    doctor.attach()
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        call_safely(doctor.explain, exc)
        if previous is sys.__excepthook__:   # print as `python script.py` would, without ampdoctor's frames
            shown = call_safely(without_own_frames, tb, sys.argv[0] if sys.argv else "") or tb
            traceback.print_exception(kind, exc, shown)
        else:
            previous(kind, exc, tb)

    sys.excepthook = excepthook
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

