"""Python runs this at the start of every child process of `ampdoctor run` (this folder is first on PYTHONPATH).

It is coverage.py's mechanism for measuring subprocesses: a start-up hook enabled by an environment variable. It
does nothing unless ``AMPDOCTOR_CHILD_DIR`` is set, imports no torch itself (a Doctor attaches once the child
imports torch), and then runs the ``sitecustomize`` it shadows, if there is one.
"""

import os
import sys


def _run_shadowed_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("AMPDOCTOR_CHILD_DIR"):
    try:
        from ampdoctor.runner.child import install

        install()
    except Exception as exc:  # never stop the child from starting
        print(f"ampdoctor: could not follow this child process ({type(exc).__name__}: {exc})", file=sys.stderr)
_run_shadowed_sitecustomize()
