"""Start-up hooks: a Doctor attached to a Python process before its script's first line, once it imports torch.

Two switches use the same mechanism, coverage.py's for measuring subprocesses (a start-up hook enabled by an
environment variable):

- ``ampdoctor run`` follows its child processes: ``AMPDOCTOR_CHILD_DIR`` (``runner/children.py``, ``runner/child.py``).
- ``AMPDOCTOR=1 python train.py`` (or ``AMPDOCTOR="--fix --json report.json"``): ``ampdoctor.attach()`` for a
  process started by someone else (a scheduler's wrapper, a job that must be started as ``python train.py``). The
  ``ampdoctor-env.pth`` file installed with the package calls `install_from_environment` when ``AMPDOCTOR`` is set;
  every child Python process that inherits the variable (a torchrun worker, a ``multiprocessing`` child) attaches too,
  and one that trains nothing says nothing.

This module imports no torch: it runs while ``site`` starts the interpreter. The Doctor attaches when the script's
``import torch`` has finished, so the names the script binds from torch afterwards are the observed ones.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import shlex
import sys
from typing import Any, Callable

ENV = "AMPDOCTOR"
CHILD_ENV_DIR = "AMPDOCTOR_CHILD_DIR"   # runner.child.ENV_DIR: a child of `ampdoctor run`, which that hook follows
_OFF = ("", "0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")

__all__ = ["ENV", "after_torch_import", "install_from_environment", "options_from_environment"]


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Call ``then()`` once ``import torch`` has finished executing torch's package."""

    def __init__(self, then: Callable[[], Any]) -> None:
        self.then = then

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
            if _importing_ampdoctor():   # `ampdoctor.attach` imported torch: attach once that import is done
                _deferred.append(self.then)
            else:
                self.then()

        loader.exec_module = exec_then_start  # type: ignore[method-assign]
        return spec


_deferred: list[Callable[[], Any]] = []   # a hook that torch's import fired while a module of ampdoctor was importing


def _importing_ampdoctor() -> bool:
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items()) if name.split(".")[0] == "ampdoctor")


def run_deferred() -> None:
    """Run the hooks deferred while ampdoctor's own modules imported torch (``ampdoctor.__getattr__`` calls this
    after its lazy import: the first line ``import ampdoctor; ampdoctor.attach()`` imports torch)."""
    while _deferred and not _importing_ampdoctor():
        _deferred.pop(0)()


def after_torch_import(then: Callable[[], Any]) -> None:
    """Call ``then()`` now if torch is imported already, else right after the process imports it."""
    if "torch" in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, _AfterTorchImport(then))


def options_from_environment(value: str) -> dict[str, Any]:
    """Return ``attach()``'s options from the value of ``AMPDOCTOR``: ``1`` for the defaults, else ``ampdoctor run``'s
    options (``--fix``, ``--json PATH``, ``--log-dir DIR``, ``--every N``, ``--activations``, ``--no-watch``).

    Raises:
        ValueError: for a value that is neither, with what to write instead.

    >>> options_from_environment("1")
    {}
    >>> options_from_environment("--fix --every 10 --json r.json")
    {'fix': True, 'every': 10, 'json_path': 'r.json'}
    """
    if value.strip().lower() in _ON:
        return {}
    try:
        words = shlex.split(value)
    except ValueError as exc:
        raise ValueError(f"{ENV}={value!r} cannot be read ({exc}); {_USE}") from None
    options: dict[str, Any] = {}
    flags = {"--fix": ("fix", True), "--activations": ("activations", True), "--no-watch": ("watch", False),
             "--no-audit": ("audit", "off"), "--audit": ("audit", "auto"), "--audit-every": ("audit", "all")}
    valued = {"--json": "json_path", "--log-dir": "log_dir", "--every": "every", "--audit-steps": "audit"}
    while words:
        word = words.pop(0)
        name, _, given = word.partition("=")
        if word in flags:
            options[flags[word][0]] = flags[word][1]
        elif name in valued and (given or words):
            text = given or words.pop(0)
            if name == "--every":
                from ampdoctor.core.options import check_every  # no torch: before the script starts

                try:
                    options["every"] = check_every(int(text) if text.isdigit() else text, "--every")
                except ValueError as exc:
                    raise ValueError(f"{ENV}={value!r}: {exc}") from None
            else:
                options[valued[name]] = text
        else:
            what = f"{name} needs a value" if name in valued else f"{word!r} is not one of run's options"
            raise ValueError(f"{ENV}={value!r}: {what}; {_USE}")
    return options


_USE = ("use AMPDOCTOR=1, or ampdoctor run's options, e.g. AMPDOCTOR='--fix --json report.json --log-dir logs' "
        "(--fix, --json PATH, --log-dir DIR, --every N, --activations, --audit, --audit-every, --audit-steps STEPS, "
        "--no-watch)")


def install_from_environment() -> None:
    """What ``ampdoctor-env.pth`` calls at start-up where ``AMPDOCTOR`` is set: attach once torch is imported.

    A value that cannot be read stops the process before its script starts, with the reason (exit status 2), as
    ``ampdoctor run`` refuses bad options; a switched-off value (``0``, ``off``) and the children of ``ampdoctor
    run`` (which its own hook follows) do nothing.
    """
    value = os.environ.get(ENV, "")
    if value.strip().lower() in _OFF or os.environ.get(CHILD_ENV_DIR):
        return
    try:
        options = options_from_environment(value)
        from ampdoctor.core.options import RunOptions  # no torch: before the script starts

        RunOptions(**options).check_outputs("--json", "--log-dir")
    except ValueError as exc:
        print(f"ampdoctor: {exc}", file=sys.stderr, flush=True)
        os._exit(2)   # from a .pth line: SystemExit would make site print a traceback and go on
    after_torch_import(lambda: _attach(options))


def _attach(options: dict[str, Any]) -> None:
    if "ampdoctor.ui.cli" in sys.modules:
        return   # the ampdoctor command itself (`ampdoctor run` attaches its own Doctor)
    try:
        from ampdoctor.runner.attached import attach

        attach(**options, announce="environment")
    except Exception as exc:   # never stop the script from starting
        print(f"ampdoctor: {ENV}={os.environ.get(ENV)!r}: not attached ({type(exc).__name__}: {exc})",
              file=sys.stderr)
