"""The Lightning callback on a real ``lightning.Trainer``, CPU, a few steps of a tiny LightningModule.

fp16 with a GradScaler: Lightning makes no GradScaler on CPU (``16-mixed`` becomes ``bf16-mixed`` there), so these
tests hand the real ``MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))`` plugin to the
Trainer, the path a GPU run takes with Lightning's own ``GradScaler("cuda")``.
"""

from __future__ import annotations

import json

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from ampdoctor.integrations.lightning import AmpDoctorCallback, autocast_dtype_of, precision_of  # noqa: E402

STEPS = 3


class Net(L.LightningModule):
    """An encoder and a head that ``training_step`` calls directly; ``half_head`` casts the head with .half()."""

    def __init__(self, half_head: bool = False) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 1)
        if half_head:
            self.head.half()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.encoder(x)).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-4)


def _data():
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _fp16_plugin():
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def _fit(model, callbacks=(), precision=None, plugins=(), **kwargs):
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, precision=precision, plugins=list(plugins),
                        callbacks=list(callbacks), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **kwargs)
    trainer.fit(model, _data())
    return trainer


class _ReadBeforeFirstStep(L.pytorch.Callback):
    """Reads the JSON at the last moment before the first batch: what a crash at step 0 leaves."""

    def __init__(self, path):
        self.path, self.seen = path, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.seen is None:
            self.seen = json.loads(self.path.read_text())


def test_stray_fp16_head_is_named_once_and_the_crash_at_step_0_is_explained(tmp_path):
    path = tmp_path / "report.json"
    probe = _ReadBeforeFirstStep(path)
    callback = AmpDoctorCallback(json_path=path)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        _fit(Net(half_head=True), [callback, probe], plugins=[_fp16_plugin()])
    # Written before the first step, with the LightningModule's names, once (no copy from LightningOptimizer).
    assert [(f["code"], f["where"]) for f in probe.seen["findings"] if f["code"] == "AMP101"] == [("AMP101", "head")]
    assert probe.seen["exception"] is None
    data = json.loads(path.read_text())
    amp101 = [f for f in data["findings"] if f["code"] == "AMP101"]
    assert len(amp101) == 1 and "head.weight" in amp101[0]["detail"] and "head.bias" in amp101[0]["detail"]
    assert "encoder" not in amp101[0]["detail"]
    assert data["exception"]["type"] == "ValueError"
    assert "AMP101" in data["explained_by"]
    assert data["observed"] == {"models": 1, "optimizers": 1, "scalers": 1}
    assert data["framework"]["precision"] == "16-mixed" and data["framework"]["scaler"] == "GradScaler"


def test_the_findings_are_printed_once_with_the_crash_explanation(tmp_path, capsys):
    callback = AmpDoctorCallback(json_path=tmp_path / "report.json")
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        _fit(Net(half_head=True), [callback], plugins=[_fp16_plugin()])
    lines = capsys.readouterr().err.splitlines()
    assert lines.count("ampdoctor findings") == 1
    assert sum(line.startswith("AMP101 error head") for line in lines) == 1
    assert lines.count("ValueError: Attempting to unscale FP16 gradients.") == 1   # above the findings it explains
    assert sum(line.startswith("ampdoctor: report written to") for line in lines) == 1


def test_clean_bf16_run_has_no_warning_or_error(tmp_path):
    callback = AmpDoctorCallback(json_path=tmp_path / "r.json", log_dir=tmp_path / "logs", every=1)
    _fit(Net(), [callback], precision="bf16-mixed")
    report = callback.report
    assert [f for f in report.findings if f.severity.value != "info"] == []
    assert report.ok and report.exception is None
    assert report.watch.steps == STEPS
    assert report.extra["framework"]["precision"] == "bf16-mixed"
    lines = (tmp_path / "logs" / "ampdoctor.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["type"] == "report"   # the flight recorder ends with the run's report


def test_fix_upcasts_the_stray_head_before_the_first_step(tmp_path):
    model = Net(half_head=True)
    callback = AmpDoctorCallback(json_path=tmp_path / "r.json", fix=True)
    trainer = _fit(model, [callback], plugins=[_fp16_plugin()])
    assert trainer.global_step == STEPS
    assert model.head.weight.dtype == torch.float32 and torch.isfinite(model.head.weight).all()
    report = callback.report
    assert any("head.weight" in c for c in report.changes)
    assert [f.severity.value for f in report.findings if f.code == "AMP101"] == ["info"]
    assert report.exception is None


def test_pre_clip_norm_of_gradient_clip_val_is_reported():
    callback = AmpDoctorCallback()
    _fit(Net(), [callback], precision="bf16-mixed", gradient_clip_val=1e-3)
    clipping = callback.report.extra["clipping"]
    assert clipping["calls"] == STEPS and clipping["clipped"] == STEPS and clipping["peak"] > 1e-3
    [finding] = [f for f in callback.report.findings if f.code == "AMP611"]
    assert finding.where == "Trainer(gradient_clip_val=0.001)"


@pytest.mark.parametrize("kind", ["bf16-mixed", "16-mixed+GradScaler"])
def test_weights_are_bitwise_identical_with_the_callback(kind):
    def train(callbacks):
        torch.manual_seed(0)
        model = Net()
        if kind == "bf16-mixed":
            _fit(model, callbacks, precision="bf16-mixed", gradient_clip_val=0.5)
        else:
            _fit(model, callbacks, plugins=[_fp16_plugin()], gradient_clip_val=0.5)
        return model.state_dict()

    plain = train([])
    watched = train([AmpDoctorCallback(every=1, activations=True)])
    assert plain.keys() == watched.keys()
    for name in plain:
        assert torch.equal(plain[name], watched[name]), name


def test_true_half_precision_is_pure_half_training(tmp_path):
    callback = AmpDoctorCallback()
    trainer = _fit(Net(), [callback], precision="bf16-true")
    assert precision_of(trainer) == "bf16-true" and autocast_dtype_of(trainer) is None
    amp103 = [f for f in callback.report.findings if f.code == "AMP103"]
    assert amp103 and "encoder.0.weight" in amp103[0].detail   # the LightningModule's names


def test_precision_flags_are_read_without_constructing_the_plugin():
    # TransformerEngine is not installed here: the plugin class states its flag as a class attribute.
    from lightning.pytorch.plugins.precision import HalfPrecision, TransformerEnginePrecision

    te = L.Trainer(accelerator="cpu", logger=False)
    te.strategy._precision_plugin = object.__new__(TransformerEnginePrecision)   # no transformer_engine import
    assert precision_of(te) == "transformer-engine" and autocast_dtype_of(te) is None
    half = L.Trainer(accelerator="cpu", logger=False, plugins=[HalfPrecision("16-true")])
    assert precision_of(half) == "16-true" and autocast_dtype_of(half) is None
    fp16 = L.Trainer(accelerator="cpu", logger=False, plugins=[_fp16_plugin()])
    assert precision_of(fp16) == "16-mixed" and autocast_dtype_of(fp16) is torch.float16
    assert autocast_dtype_of(L.Trainer(accelerator="cpu", logger=False)) is None


def test_bad_arguments_are_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="every"):
        AmpDoctorCallback(every=0)
    with pytest.raises(ValueError, match="is a folder"):   # as attach() and `ampdoctor run --json` say it
        AmpDoctorCallback(json_path=tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot be created"):   # checked before the run, not at its end
        AmpDoctorCallback(log_dir=blocker / "logs")


def test_an_internal_failure_never_stops_the_training(tmp_path):
    callback = AmpDoctorCallback(log_dir=tmp_path / "logs", every=1)
    (tmp_path / "logs").rmdir()
    (tmp_path / "logs").write_text("")   # made a file after the check: the flight recorder cannot be opened
    trainer = _fit(Net(), [callback], precision="bf16-mixed")
    assert trainer.global_step == STEPS
    assert "AMP001" in callback.report.codes() and callback.report.exception is None


def test_it_is_a_callback_of_pytorch_lightning_too():
    pytest.importorskip("pytorch_lightning")
    import subprocess
    import sys

    code = ("import pytorch_lightning as pl; from ampdoctor.integrations.lightning import AmpDoctorCallback; "
            "import lightning.pytorch as lp; c = AmpDoctorCallback(); "
            "assert isinstance(c, pl.Callback) and isinstance(c, lp.Callback)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
