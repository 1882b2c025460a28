"""The watch's scalars as TensorBoard events, read back with TensorBoard's own reader."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.ui.report_files import load_any
from ampdoctor.ui.tensorboard_export import INSTALL_TENSORBOARD, write_tensorboard


def _log(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # the first steps overflow, then the scale settles
    with ampdoctor.watch(model, opt, scaler, every=1, log_dir=str(tmp_path / "logs")):
        for _ in range(12):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return load_any(str(tmp_path / "logs"))


def test_scalars_are_written_and_read_back_by_tensorboard(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    n = write_tensorboard(_log(tmp_path), str(tmp_path / "tb"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"ampdoctor/loss_scale", "ampdoctor/skipped_steps", "ampdoctor/grad_norm", "ampdoctor/grad_norm/0",
            "ampdoctor/grad_norm/2"} <= set(tags)
    assert n == sum(len(events.Scalars(t)) for t in tags)
    scale = [(e.step, e.value) for e in events.Scalars("ampdoctor/loss_scale")]
    assert scale[0] == (0, 2.0**24) and scale[-1][1] < 2.0**24  # the calibration skips lowered it
    assert len(events.Scalars("ampdoctor/grad_norm")) == 12  # every step was sampled


def test_without_tensorboard_it_says_how_to_get_it(tmp_path):
    code = ("import sys; sys.modules['tensorboard'] = None; sys.modules['torch.utils.tensorboard'] = None\n"
            "from ampdoctor.ui.tensorboard_export import write_tensorboard\n"
            "try:\n    write_tensorboard(None, 'x')\nexcept ValueError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == INSTALL_TENSORBOARD, done.stderr


def test_report_tensorboard_option(tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    from ampdoctor.ui.cli import main

    _log(tmp_path)
    assert main(["report", str(tmp_path / "logs"), "--tensorboard", str(tmp_path / "tb")]) == 0
    assert "scalar values written for TensorBoard" in capsys.readouterr().out
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
