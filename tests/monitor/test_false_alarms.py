"""The watch stays quiet on correct runs and still fires on real trouble.

Each quiet run is sampled densely (every=1) so the checks run on every step, and asserts that statistics were
read, so it cannot pass by looking at nothing. Each rule whose criterion changed has a positive control.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampdoctor.core.findings import Severity
from ampdoctor.monitor.watcher import watch

STEPS = 60


def train(model: nn.Module, batch, loss_fn, *, dtype: torch.dtype | None = torch.float16, init_scale: float | None
          = 2.0**16, steps: int = STEPS, lr: float = 1e-3, **scaler_kw):
    """Train under autocast (``dtype``; None: fp32) with a GradScaler (``init_scale`` None: none) and a watch."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = None if init_scale is None else torch.amp.GradScaler("cpu", init_scale=init_scale, **scaler_kw)
    data = torch.Generator().manual_seed(1)
    with watch(model, opt, scaler, every=1) as w:
        for step in range(steps):
            x, y = batch(data)
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = loss_fn(model, x, y)
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    return w


def loud(w) -> list[tuple[str, str, str]]:
    return [(f.code, f.where, f.detail) for f in w.findings() if f.severity in (Severity.ERROR, Severity.WARNING)]


def assert_quiet_and_sampled(w, steps: int = STEPS) -> None:
    assert w.steps == steps and w.sampled_steps == steps
    assert w.last_grads and all("fp16_subnormal" in s and s["sampled"] > 0 for s in w.last_grads.values())
    assert loud(w) == []


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))


def mlp_batch(gen: torch.Generator):
    return torch.randn(32, 16, generator=gen), torch.randint(4, (32,), generator=gen)


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float(), y)


def test_a_correct_bf16_autocast_run_is_quiet() -> None:
    w = train(mlp(), mlp_batch, cross_entropy, dtype=torch.bfloat16, init_scale=None)
    assert_quiet_and_sampled(w)


def test_a_correct_fp16_run_with_calibration_skips_is_quiet() -> None:
    # 2**22 overflows the fp16 backward: the first steps are skipped while the scale halves, then it settles.
    w = train(mlp(), mlp_batch, cross_entropy, init_scale=2.0**22)
    scale = w.summary_data()["scale"]
    assert 0 < scale["skipped"] < 8 and scale["longest_skip_run"]["first_step"] == 0
    assert scale["current"] < 2.0**22
    assert_quiet_and_sampled(w)


class ConvBN(nn.Module):
    """Conv (bias=True) -> BatchNorm twice: BatchNorm subtracts the batch mean, so each conv bias's gradient is 0
    up to rounding. ``fp32_stem``: the stem runs outside autocast (BatchNorm kept in fp32, as apex's
    keep_batchnorm_fp32 did), so that residue is fp32 rounding, far below the other gradients."""

    def __init__(self, fp32_stem: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fp32_stem = fp32_stem
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=True), nn.BatchNorm2d(16), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=True), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=not self.fp32_stem and torch.is_autocast_enabled("cpu"),
                            dtype=torch.float16):
            h = self.stem(x)
        return self.body(h)


@pytest.mark.parametrize("fp32_stem", [False, True])
def test_conv_bias_before_batchnorm_raises_no_underflow(fp32_stem: bool) -> None:
    # Was AMP605 on stem.0.bias with the fp32 stem: "0.0% would round to 0 ... 12.5% are fp16 subnormals".
    def batch(gen: torch.Generator):
        return torch.randn(16, 3, 16, 16, generator=gen), torch.randint(10, (16,), generator=gen)

    w = train(ConvBN(fp32_stem), batch, cross_entropy, steps=30, lr=1e-2)
    assert_quiet_and_sampled(w, 30)
    bias, weight = w.last_grads["stem.0.bias"], w.last_grads["stem.0.weight"]
    assert bias["absmax"] < 1e-3 * weight["absmax"]  # the residue, far below the real gradients
    if fp32_stem:
        assert bias["negligible_frac"] > 0  # entries below 2**-24 of the largest gradient: left out


def test_tiny_bert_under_fp16_autocast_is_quiet() -> None:
    # Was AMP605 on every attention key bias: softmax is shift-invariant, so their gradient is 0 up to rounding.
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)

    def batch(gen: torch.Generator):
        return torch.randint(100, (4, 16), generator=gen), torch.randint(2, (4,), generator=gen)

    w = train(model, batch, lambda m, x, y: m(input_ids=x, labels=y).loss, steps=40)
    assert_quiet_and_sampled(w, 40)
    key_bias = w.last_grads["bert.encoder.layer.0.attention.self.key.bias"]
    assert key_bias["negligible_frac"] == 1.0  # all of it rounding residue next to the largest gradient


def test_a_huge_loss_scale_on_fp32_gradients_is_no_nonfinite_norm() -> None:
    # Was AMP608: at 2**60 the stored gradients (~1e3 * 1.2e18) are finite, but their float32 sum of squares is
    # not; the GradScaler found no inf and did not skip, and the norm read inf.
    torch.manual_seed(0)
    model = nn.Linear(8, 8)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (m(x) * 1e3).pow(2).mean() * 1e-3

    w = train(model, lambda gen: (torch.randn(16, 8, generator=gen), None), loss_fn, dtype=None,
              init_scale=2.0**60, steps=5, growth_interval=10**6)
    assert w.summary_data()["scale"]["skipped"] == 0
    assert math.isfinite(w.summary_data()["gradients"]["global_norm"])
    assert "AMP608" not in [f.code for f in w.findings()]


# ---- positive controls --------------------------------------------------------------------------------------
class TwoBranch(nn.Module):
    """Two parallel layers; ``small``'s output is scaled by 1e-6, so its gradients are ~1e-6 of ``big``'s: real
    signal (far above 2**-24 of the largest), and below fp16's 2**-24 ≈ 6e-8 at a loss scale of 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big, self.small = nn.Linear(32, 4), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(x) + 1e-6 * self.small(x)


def test_a_tiny_gradient_layer_at_loss_scale_1_still_raises_amp605() -> None:
    w = train(TwoBranch(), lambda gen: (torch.randn(64, 32, generator=gen), torch.randint(4, (64,), generator=gen)),
              cross_entropy, dtype=None, init_scale=1.0, steps=3)
    flagged = {f.where for f in w.findings() if f.code == "AMP605"}
    assert flagged == {"small.weight", "small.bias"}
    small = w.last_grads["small.weight"]
    assert small["fp16_underflow"] > 0.1 and small["negligible_frac"] < 0.5


def test_a_forward_overflow_on_every_step_still_raises_amp603() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(3e4)  # 1.2e5 > 65504 in fp16 on every forward

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return m(x).float().pow(2).mean()

    w = train(model, lambda gen: (torch.ones(2, 4), None), loss_fn, steps=12)
    assert w.summary_data()["scale"]["skipped"] == 12
    assert "AMP603" in [f.code for f in w.findings() if f.severity is Severity.ERROR]


def test_a_real_nonfinite_gradient_without_a_scaler_still_raises_amp608() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (m(x) * 1e30).pow(2).sum()  # 1e60 overflows float32: inf loss, inf/NaN gradients

    w = train(model, lambda gen: (torch.randn(3, 4, generator=gen), None), loss_fn, dtype=None, init_scale=None,
              steps=2)
    finding = next(f for f in w.findings() if f.code == "AMP608")
    assert finding.step == 0 and "weight" in finding.where


def test_no_unskipped_claim_once_the_loss_scale_part_is_off(monkeypatch) -> None:
    # When the watch's loss-scale part fails (AMP001), it no longer knows which steps the GradScaler skipped, so
    # the inf gradients of a skipped step must not be called "not skipped" (AMP608). Positive control: the same
    # run without a GradScaler, where nobody skips, raises AMP608.
    from ampdoctor.monitor.loss_scale import ScaleMonitor

    def broken(self, new_scale=None):
        raise RuntimeError("the loss-scale part fails")

    monkeypatch.setattr(ScaleMonitor, "_before_update", broken)

    def overflow(data):
        return torch.full((4, 8), 3e4), torch.zeros(4, 1)   # fp16 Linear output: |y| > 65504 -> inf

    def loss_fn(model, x, y):
        return (model(x).float() - y).pow(2).mean()

    w = train(nn.Linear(8, 1), overflow, loss_fn, steps=3)
    assert [f.code for f in w.findings() if f.code in ("AMP001", "AMP608")] == ["AMP001"]
    w = train(nn.Linear(8, 1), overflow, loss_fn, steps=3, init_scale=None)
    assert "AMP608" in [f.code for f in w.findings()]


def test_no_unskipped_claim_for_a_step_that_crashed_before_it_ended() -> None:
    # The classic crash: an fp16 parameter under a GradScaler, whose unscale_ raises inside scaler.step(). The
    # watch read that step's (non-finite) gradients just before; they are recorded when the watch detaches, as a
    # partial step. That step neither stepped nor skipped, so AMP608 ("not skipped") would be false; it said
    # "at step -1" too (corpus case a04).
    torch.manual_seed(0)
    model = nn.Linear(8, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with watch(model, opt, scaler, every=1) as w:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.full((4, 8), 3e4, dtype=torch.float16)).float().sum()   # inf: gradients non-finite
        scaler.scale(loss).backward()
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            scaler.step(opt)
    assert w.last_record is not None and w.last_record.get("partial")   # the crashed step's gradients were read
    assert not math.isfinite(w.last_record["gradients"]["global_norm"])
    assert [f.code for f in w.findings() if f.code == "AMP608"] == []
