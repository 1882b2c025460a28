"""The callback examples run as users run them: ``python examples/...`` in a fresh process, on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


def test_lightning_example_repairs_the_stray_head(tmp_path):
    pytest.importorskip("lightning")
    result = _run("lightning_callback.py", "--fix", "--steps", "6", "--json", "report.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 6 steps" in result.stdout
    assert "head.weight: upcast torch.float16 -> torch.float32" in result.stderr   # printed by the callback
    data = json.loads((tmp_path / "report.json").read_text())
    assert [f["severity"] for f in data["findings"] if f["code"] == "AMP101"] == ["info"]
    assert data["exception"] is None and data["watch"]["steps"] == 6


def test_trainer_example_flags_the_half_model(tmp_path):
    pytest.importorskip("transformers")
    result = _run("trainer_callback.py", "--half", "--steps", "4", "--json", "report.json", "--out",
                  str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 4 steps" in result.stdout and "AMP209" in result.stderr
    data = json.loads((tmp_path / "report.json").read_text())
    assert "AMP209" in [f["code"] for f in data["findings"]]
    assert data["watch"]["steps"] == 4
