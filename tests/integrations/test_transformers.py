"""The transformers callback on a real ``Trainer`` (accelerate underneath), CPU, a few steps of tiny models.

fp16 with a GradScaler: on CPU accelerate turns ``fp16=True`` into nothing (no autocast, no GradScaler: AMP203). The
scaler tests give the Trainer's real Accelerator what it builds on a GPU, a ``torch.amp.GradScaler`` and
``native_amp=True`` (then ``prepare`` wraps the forward in fp16 autocast), before ``train()``: the fp16 path of a GPU
run, driven by the Trainer and accelerate's own code.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

from ampdoctor.integrations.transformers import AmpDoctorCallback  # noqa: E402

STEPS = 3


def _bert():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    return BertForSequenceClassification(config)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8 * STEPS

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": torch.tensor(i % 2)}


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1).float(), labels)}


class Points(torch.utils.data.Dataset):
    """Samples 8..15 (the second batch) hold a NaN: the loss of step 1 is NaN, and NaN weights follow."""

    def __len__(self):
        return 8 * STEPS

    def __getitem__(self, i):
        if 8 <= i < 16:
            x = torch.full((4,), float("nan"))
        else:
            x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return {"x": x, "labels": torch.tensor(float(i % 3))}


def _args(tmp_path, **kwargs):
    options = dict(output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=8,
                   report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
    return TrainingArguments(**{**options, **kwargs})


def _train(model, args, dataset, callbacks=(), scaler=False):
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=list(callbacks))
    if scaler:   # what accelerate builds for fp16 on a GPU (see the module docstring)
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
        trainer.accelerator.native_amp = True
    trainer.train()
    return trainer


def test_clean_bf16_run_has_no_warning_or_error(tmp_path):
    callback = AmpDoctorCallback(json_path=tmp_path / "r.json", log_dir=tmp_path / "logs", every=1)
    trainer = _train(_bert(), _args(tmp_path, bf16=True, max_grad_norm=1e6), Tokens(), [callback])
    assert {"training_step", "_run_epoch"}.isdisjoint(vars(trainer))   # the observers are gone
    report = callback.report
    assert [f for f in report.findings if f.severity.value != "info"] == []
    assert report.ok and report.observed == {"models": 1, "optimizers": 1, "scalers": 0}
    assert report.watch.steps == STEPS
    assert report.extra["framework"]["autocast"] == "bfloat16"
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ok"] is True
    assert json.loads((tmp_path / "logs" / "ampdoctor.jsonl").read_text().splitlines()[-1])["type"] == "report"


def test_fp16_flag_on_a_half_loaded_model_is_flagged(tmp_path):
    callback = AmpDoctorCallback()
    _train(_bert().half(), _args(tmp_path, fp16=True), Tokens(), [callback])
    codes = callback.report.codes()
    [finding] = [f for f in callback.report.findings if f.code == "AMP209"]
    assert finding.where == "TrainingArguments(fp16=True)"
    assert "bert.embeddings.word_embeddings.weight" in finding.detail
    assert "all 25 trainable parameters are float16" in finding.detail
    assert "AMP203" in codes   # and accelerate ignores fp16 on CPU


def test_the_findings_are_printed_once(tmp_path, capsys):
    callback = AmpDoctorCallback(json_path=tmp_path / "r.json")
    _train(_bert().half(), _args(tmp_path, fp16=True), Tokens(), [callback])
    lines = capsys.readouterr().err.splitlines()
    assert lines.count("ampdoctor findings") == 1
    for code in ("AMP203", "AMP209"):
        assert sum(line.startswith(f"{code} warning") for line in lines) == 1, code
    assert sum(line.startswith("ampdoctor: report written to") for line in lines) == 1


def test_fp32_model_with_fp16_flag_is_not_flagged_as_half(tmp_path):
    callback = AmpDoctorCallback()
    _train(_bert(), _args(tmp_path, fp16=True), Tokens(), [callback], scaler=True)
    assert "AMP209" not in callback.report.codes() and "AMP101" not in callback.report.codes()
    assert callback.report.observed["scalers"] == 1 and callback.report.watch.steps == STEPS


def test_half_model_under_the_scaler_crashes_and_the_json_explains_it(tmp_path):
    path = tmp_path / "r.json"
    model = _bert().half()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        _train(model, _args(tmp_path, fp16=True), Tokens(), [AmpDoctorCallback(json_path=path)], scaler=True)
    data = json.loads(path.read_text())
    assert data["exception"]["type"] == "ValueError" and "AMP101" in data["explained_by"]
    places = [f["where"] for f in data["findings"] if f["code"] == "AMP101"]
    assert "classifier" in places and len(places) == len(set(places))   # each module once
    assert "AMP209" in [f["code"] for f in data["findings"]]


def test_fix_upcasts_the_half_model_and_training_finishes(tmp_path):
    model = _bert().half()
    callback = AmpDoctorCallback(fix=True)
    trainer = _train(model, _args(tmp_path, fp16=True), Tokens(), [callback], scaler=True)
    assert trainer.state.global_step == STEPS and model.classifier.weight.dtype == torch.float32
    assert callback.report.exception is None
    assert {f.severity.value for f in callback.report.findings if f.code in ("AMP101", "AMP209")} == {"info"}


@pytest.mark.parametrize("nan_filter", [True, False])
def test_nan_losses_hidden_by_logging_nan_inf_filter(tmp_path, nan_filter):
    callback = AmpDoctorCallback()
    trainer = _train(Regressor(), _args(tmp_path, bf16=True, logging_nan_inf_filter=nan_filter,
                                                train_sampling_strategy="sequential"), Points(), [callback])
    hidden = [f for f in callback.report.findings if f.code == "AMP610"]
    if nan_filter:
        [finding] = hidden
        assert finding.step == 1 and "2 of 3 training losses" in finding.detail
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert all(v == v for v in logged)   # what the finding says: the logs show no NaN
    else:
        assert hidden == []   # the logged loss shows the NaN itself


def test_pre_clip_norm_under_max_grad_norm_is_reported(tmp_path):
    callback = AmpDoctorCallback()
    trainer = _train(_bert(), _args(tmp_path, bf16=True, max_grad_norm=1e-3), Tokens(), [callback])
    clipping = callback.report.extra["clipping"]
    assert clipping["calls"] == STEPS and clipping["clipped"] == STEPS and clipping["max_norm"] == 1e-3
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert clipping["last"] == pytest.approx(logged[-1], rel=1e-5)   # the Trainer's own pre-clip value
    [finding] = [f for f in callback.report.findings if f.code == "AMP611"]
    assert finding.where == "TrainingArguments(max_grad_norm=0.001)"


def test_no_clipping_finding_when_nothing_was_clipped(tmp_path):
    callback = AmpDoctorCallback()
    _train(_bert(), _args(tmp_path, bf16=True, max_grad_norm=1e6), Tokens(), [callback])
    assert callback.report.extra["clipping"]["clipped"] == 0 and "AMP611" not in callback.report.codes()


@pytest.mark.parametrize("scaler", [False, True], ids=["bf16", "fp16+GradScaler"])
def test_weights_are_bitwise_identical_with_the_callback(tmp_path, scaler):
    flags = dict(fp16=True) if scaler else dict(bf16=True)

    def train(callbacks):
        model = _bert()
        _train(model, _args(tmp_path, **flags), Tokens(), callbacks, scaler=scaler)
        return model.state_dict()

    plain = train([])
    watched = train([AmpDoctorCallback(every=1, activations=True)])
    for name in plain:
        assert torch.equal(plain[name], watched[name]), name
