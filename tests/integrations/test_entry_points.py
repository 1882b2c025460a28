"""Every entry point says the same words of one script: ``ampdoctor run``, ``attach()``, ``AMPDOCTOR=...``, the
notebook extension and the Lightning callback (``session.run.end_run`` ends each run, ``core.options.RunOptions``
holds what each was asked).

The script (``scripts/entry_points.py``) trains a Lightning model whose head a stray ``.half()`` left in float16:
plainly, the findings (AMP103, the lost updates in the watch's table); with the fix, its event lines and the closing
line. Each entry point once named the fix its own way (``by fix=True`` after ``ampdoctor --fix: ...`` in one
``attach(fix=True)`` run; ``the training code`` from the callback): now every one prints the same lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch_jobs import clean_environment

SCRIPT = Path(__file__).parent / "scripts" / "entry_points.py"
SRC = str(Path(__file__).resolve().parents[2] / "src")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _process(tmp_path: Path, command: list[str], **env: str) -> str:
    environment = clean_environment(COLUMNS="80", OMP_NUM_THREADS="1", **env)
    environment["PYTHONPATH"] = SRC + os.pathsep + environment.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, *command], cwd=tmp_path, env=environment, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-3000:]
    return done.stderr


def _notebook(tmp_path: Path, mode: str) -> str:
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("ipykernel")
    cells = ["%load_ext ampdoctor", *(["%ampdoctor --fix"] if mode == "fix" else []),
             f"%run {SCRIPT} {mode}", "%unload_ext ampdoctor"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(tmp_path)}})
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = SRC + (os.pathsep + saved if saved else "")
    try:
        client.execute()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
    run, unload = nb.cells[-2].outputs, nb.cells[-1].outputs
    return "".join(o.get("text") or o.get("data", {}).get("text/plain", "") for o in [*run, *unload])


def _said(output: str) -> list[str]:
    """ampdoctor's lines, in order: the script's own ``done`` and blank lines left out."""
    return [line.rstrip() for line in ANSI.sub("", output).splitlines() if line.strip() and line.strip() != "done"]


@pytest.mark.parametrize("mode", ["plain", "fix"])
def test_every_entry_point_prints_the_same_findings_and_closing_words(tmp_path, mode):
    fix = ["--fix"] if mode == "fix" else []
    said = {
        "ampdoctor run": _said(_process(tmp_path, ["-m", "ampdoctor", "run", *fix, str(SCRIPT), mode])),
        "attach()": _said(_process(tmp_path, [str(SCRIPT), mode, "attach"])),
        "AMPDOCTOR=...": _said(_process(tmp_path, [str(SCRIPT), mode], AMPDOCTOR=fix[0] if fix else "1")),
        "the Lightning callback": _said(_process(tmp_path, [str(SCRIPT), mode, "callback"])),
        "the notebook": _said(_notebook(tmp_path, mode)),
    }
    run = said["ampdoctor run"]
    if mode == "plain":
        assert "ampdoctor findings" in run and any(line.startswith("AMP103 warning") for line in run)
        assert "head.weight  float16   22%" in run   # the lost updates, from the watch's table
    else:
        assert run[0].startswith("ampdoctor --fix: fp32 master weights") and "ampdoctor --fix resolved AMP103 " \
            "(1 place)" in run
        assert run[-2:] == ["ampdoctor: no findings left after 2 changes by --fix; what it repaired (AMP103)",
                            "    is still in the script"]
    for entry, lines in said.items():
        assert lines == run, entry
