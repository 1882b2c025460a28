"""Averaged copies updated outside the optimizer (``ampdoctor.monitor.averages``, AMP619), on real
``torch.optim.swa_utils.AveragedModel`` and diffusers ``EMAModel`` loops (tests/scripts/ema_copies.py). Before the
meter each of these runs ended in the all-clear, the bf16 averages included."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch

from ampdoctor.ui.cli import main

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "ema_copies.py")
SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def run(tmp_path, kind: str, save: str | None = None) -> dict:
    path = tmp_path / f"{kind}.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(["run", "--json", str(path), SCRIPT, kind, *([save] if save else [])])
    assert code == 0, err.getvalue()
    return json.loads(path.read_text())


@pytest.mark.parametrize("kind", ["swa-bf16", "ema-bf16"])
def test_a_bf16_average_whose_updates_round_away_is_named(tmp_path, kind):
    if kind.startswith("ema"):
        pytest.importorskip("diffusers")
    report = run(tmp_path, kind)
    [finding] = [f for f in report["findings"] if f["code"] == "AMP619"]
    assert finding["severity"] == "warning" and "2.weight" in finding["where"]
    [copy] = report["watch"]["averages"]
    assert copy["calls"] == 24 and copy["sampled"] == 10 and copy["dtypes"]["2.weight"] == "bfloat16"
    # the first update copies the model (everything moves); the nine after it lose almost everything
    assert copy["lost"] / copy["apart"] > 0.8 and copy["tensors"]["2.weight"] > 0.8
    assert f"{copy['lost'] / copy['apart']:.1%} of the sampled entries that differed" in finding["detail"]


@pytest.mark.parametrize("kind", ["swa-fp32", "ema-fp32"])
def test_an_fp32_average_is_quiet_and_measured(tmp_path, kind):
    if kind.startswith("ema"):
        pytest.importorskip("diffusers")
    report = run(tmp_path, kind)
    assert report["findings"] == [] and report["ok"]
    assert report["watch"]["averages"] is None   # no half-precision averaged tensor: nothing to round away


def test_the_average_is_bitwise_the_same_with_the_meter(tmp_path):
    # the meter reads the averaged and the model's entries; the averaged weights saved are the same bytes
    plain, watched = tmp_path / "plain.pt", tmp_path / "watched.pt"
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC)}
    subprocess.run([sys.executable, SCRIPT, "swa-bf16", str(plain)], check=True, env=env, timeout=300)
    run(tmp_path, "swa-bf16", str(watched))
    assert all(torch.equal(a, b) for a, b in zip(torch.load(plain), torch.load(watched), strict=True))
