"""AMP208 (fp16 autocast without a GradScaler) carries what the watch measured, not only the prediction."""

import torch
from torch import nn

import ampdoctor
from ampdoctor.session.evidence import with_watch_evidence


def _train(steps: int = 5, clip: float | None = None, noise: float = 1e-4):
    # failures.md row 33: a small mean loss under fp16 autocast and no scaler; its per-element gradients (~3e-9)
    # are below fp16's smallest subnormal, so the fp16 backward flushes most of them to 0.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.randn(4096, 16)
    with torch.no_grad():
        y = model(x) + noise * torch.randn(4096, 16)
    with ampdoctor.watch(model, opt, every=1) as w:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            if clip is not None:   # what `ampdoctor run` tells the watch of a clip_grad_norm_ call
                w.note_clip(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            opt.step()
    return model, opt, w.summary_data()


def test_amp208_names_the_measured_fp16_floor_and_the_modules_it_flushes():
    model, opt, watch = _train()
    [amp208] = [f for f in ampdoctor.check(model, opt, autocast_dtype=torch.float16).findings if f.code == "AMP208"]
    assert "measured" not in amp208.detail
    assert amp208.severity is ampdoctor.Severity.WARNING  # the prediction: it can flush gradients
    measured = with_watch_evidence(amp208, watch)
    assert amp208.detail in measured.detail and "The watch measured, at step 4:" in measured.detail
    assert "every gradient entry of 0, 2 is exactly 0 (the fp16 backward flushed them): nothing trains" \
        in measured.detail
    assert measured.severity is ampdoctor.Severity.ERROR  # nothing trains: broken


def test_gradients_read_after_a_shrinking_clip_are_not_taken_for_what_the_fp16_backward_lost():
    # gradients of about 1e-3 clipped to a norm of 1e-9: the fp16 shares of what was read are not the backward's
    model, opt, watch = _train(steps=2, clip=1e-9, noise=1.0)
    assert watch["gradients"]["pre_clip_norm"] > 1e5 * watch["gradients"]["global_norm"]
    [amp208] = [f for f in ampdoctor.check(model, opt, autocast_dtype=torch.float16).findings if f.code == "AMP208"]
    measured = with_watch_evidence(amp208, watch)
    assert "after a clip had shrunk them" in measured.detail and "%" not in measured.detail
    assert "smallest non-zero" not in measured.detail


def test_a_module_share_counts_each_entry_once():
    # the subnormal share already holds the entries that round to 0: 60% round to 0 and 70% are subnormal
    f = ampdoctor.Finding("AMP208", ampdoctor.Severity.WARNING, "torch.autocast", "x")
    fc = {"fp16_underflow": 0.6, "fp16_subnormal": 0.7, "min_nonzero": 1e-7, "zero_frac": 0.0}
    detail = with_watch_evidence(f, {"gradients": {"step": 1, "modules": {"fc": fc}}}).detail
    assert detail.endswith("flushes or keeps only as subnormals 70.0% of fc.")


def test_other_findings_and_a_run_without_gradient_data_are_left_alone():
    model, opt, watch = _train(steps=1)
    f = ampdoctor.check(model.half(), opt, scaler=torch.amp.GradScaler("cpu")).findings[0]
    assert with_watch_evidence(f, watch) is f
    amp208 = ampdoctor.Finding("AMP208", ampdoctor.Severity.WARNING, "torch.autocast", "x")
    assert with_watch_evidence(amp208, None) is amp208 and with_watch_evidence(amp208, {"gradients": {}}) is amp208


def test_ampdoctor_run_adds_the_evidence_to_amp208(tmp_path, capsys):
    import json
    import os

    from ampdoctor.ui.cli import main

    script = os.path.join(os.path.dirname(__file__), "..", "real", "cases", "e04_fp16_autocast_no_scaler.py")
    out = tmp_path / "r.json"
    main(["run", "--json", str(out), script])  # the script exits 1 itself: its first layer's gradient is all 0
    capsys.readouterr()
    [amp208] = [f for f in json.loads(out.read_text())["findings"] if f["code"] == "AMP208"]
    assert amp208["severity"] == "error" and "is exactly 0 (the fp16 backward flushed them)" in amp208["detail"]
