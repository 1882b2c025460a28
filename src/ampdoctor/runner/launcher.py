"""Run a user's training script in this process, as ``__main__``, with a `Doctor` attached."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import runpy
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ampdoctor.core.callsite import without_own_frames
from ampdoctor.core.report import Report
from ampdoctor.runner.attached import watched_by
from ampdoctor.runner.children import ChildProcesses
from ampdoctor.runner.doctor import Doctor
from ampdoctor.session.run import INTERRUPT_STATUS


@dataclass
class RunResult:
    """What happened: the script's exit status, the report, and whether the crash was explained."""

    exit_code: int
    report: Report
    explained: bool


def run_script(path: str, args: Sequence[str] = (), doctor: Doctor | None = None, *,
               children: ChildProcesses | None = None) -> RunResult:
    """Run ``path`` with ``sys.argv = [path, *args]`` under ``doctor``, keeping the script's exit status.

    The script's own exception is never swallowed or changed: its traceback is printed to stderr exactly as
    Python would print it, and the exit status is 1, as with ``python script.py``. With ``children``, the child
    Python processes it starts are diagnosed too and merged into the report.

    Raises:
        FileNotFoundError: when ``path`` is not a file.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such script: {path!r}; pass the path of a Python file, e.g. "
                                "`ampdoctor run train.py --epochs 1`")
    # `python train.py` (3.9+) gives __main__ an absolute __file__, and tracebacks show it (runpy makes argv[0]
    # that path too, where python keeps it as typed)
    full = os.path.abspath(path)
    return _run(lambda: runpy.run_path(full, run_name="__main__"), [path, *args], os.path.dirname(full), full, doctor,
                children)


def run_module(name: str, args: Sequence[str] = (), doctor: Doctor | None = None, *,
               children: ChildProcesses | None = None) -> RunResult:
    """Run module ``name`` as ``python -m name *args`` does, under ``doctor``; see `run_script`.

    Raises:
        ModuleNotFoundError: when no module ``name`` can be found (checked before anything runs).
    """
    sys.path.insert(0, os.getcwd())  # python -m looks in the current directory first
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise ModuleNotFoundError(f"no module named {name!r} ({exc}); pass a module importable from here, e.g. "
                                  "`ampdoctor run -m mypackage.train --epochs 1`") from None
    finally:
        sys.path.remove(os.getcwd())
    if spec is None:
        raise ModuleNotFoundError(f"no module named {name!r}; pass a module importable from the current directory "
                                  "or the environment, e.g. `ampdoctor run -m mypackage.train --epochs 1`")
    origin = spec.origin if spec.origin and spec.origin != "frozen" else name
    # python -m puts the current directory first on sys.path and sets argv[0] to the module's file.
    return _run(lambda: runpy.run_module(name, run_name="__main__", alter_sys=True), [origin, *args], os.getcwd(),
                origin, doctor, children)


def _run(body: Callable[[], Any], argv: list[str], path0: str, shown_path: str, doctor: Doctor | None,
         children: ChildProcesses | None) -> RunResult:
    doctor = doctor or Doctor()
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    hook_before = sys.excepthook
    sys.argv = argv
    sys.path.insert(0, path0)  # what `python script.py` / `python -m` does
    exit_code, explained = 0, False
    relayed: list[Any] = []
    try:
        with contextlib.ExitStack() as stack:
            if children is not None:
                stack.enter_context(children)
            with doctor, watched_by("ampdoctor run"):   # the script's own ampdoctor.attach() does nothing
                try:
                    body()
                except SystemExit as exc:
                    exit_code = _exit_status(exc.code)
                except KeyboardInterrupt as exc:   # Ctrl-C: where the script was, without ampdoctor's frames
                    exit_code = INTERRUPT_STATUS
                    _print_exception(exc, without_own_frames(exc.__traceback__, shown_path), hook_before)
                    doctor.interrupted(exc)
                except BaseException as exc:  # the script failed: keep its traceback and status
                    exit_code = 1
                    if _not_compiled(exc, shown_path):   # as python prints it: the file, the line, the caret
                        traceback.print_exception(type(exc), exc, None)
                        doctor.not_started(exc)
                    else:
                        _print_exception(exc, without_own_frames(exc.__traceback__, shown_path), hook_before)
                        found = doctor.explain(exc)
                        explained = bool(found)
                        if type(exc).__module__.startswith("torch.multiprocessing"):
                            relayed = found   # a worker's error, re-raised as text: the worker's Doctor saw it
    finally:
        sys.argv = saved_argv
        if sys.path and sys.path[0] == path0 and saved_path0 != path0:
            sys.path.pop(0)
    if children is not None:   # children that are ranks of a job: one report, as under torchrun
        own = doctor.report
        doctor.report = children.merge_ranks(own, doctor.rank_info)
        ranks = doctor.rank_info is None and doctor.report is not own   # workers of mp.spawn, each a rank
        if children.merge_into(doctor.report) or ranks:
            # A parent that failed because its child failed is explained by what the child's Doctor found; its
            # own reading of the error text the child's failure was re-raised with adds nothing to it.
            from_children = [f for f in doctor.report.findings if f.process is not None or (ranks and f.ranks)]
            codes = {f.code for f in from_children}
            # by what they say: the report holds them with its own fix command (Report.add), not as found
            said = {(f.code, f.where, f.detail) for f in relayed}
            doctor.report.findings = [f for f in doctor.report.findings
                                      if not ((f.code, f.where, f.detail) in said and f.code in codes)]
            explained = explained or bool(from_children)
    doctor.report.exit_status = exit_code or None
    return RunResult(exit_code, doctor.report, explained)


def _print_exception(exc: BaseException, tb: Any, hook_before: Any) -> None:
    """Print the script's exception as Python would: through an excepthook the script installed, if any.

    ``torch.distributed.init_process_group`` installs one that prefixes each line with ``[rank1]:``, so the
    ranks' tracebacks under torchrun read as they do without ampdoctor. A hook that was there before the script
    (another tool's, or one left by an earlier run in this process) is not the script's: it is not used.
    """
    hook = sys.excepthook
    if hook is not hook_before and hook is not sys.__excepthook__:
        whole = exc.__traceback__
        try:
            # the built-in hook at the end of such a chain prints the exception's own traceback, not the one given
            exc.__traceback__ = tb
            hook(type(exc), exc, tb)
            return
        except Exception:
            pass  # a broken hook: print it ourselves
        finally:
            exc.__traceback__ = whole   # the explanation reads every frame
    traceback.print_exception(type(exc), exc, tb)


def _not_compiled(exc: BaseException, path: str) -> bool:
    """Return whether ``exc`` is the script's own SyntaxError: it never started."""
    return isinstance(exc, SyntaxError) and bool(exc.filename) and os.path.abspath(exc.filename) == path


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
