"""The numerics audit (``monitor/numerics.py``, ``monitor/parts/numerics_audit.py``): each low-precision op of an
audited step re-run in fp32 from its own inputs, on real modules, real autocast and a real GradScaler.

Each kind of event gets a case where it fires, with the op, module and source line, and a quiet twin that uses the
same ops correctly. Then what the audit must not do: change training (bitwise), run ops on steps it does not audit,
or crash the step when it fails itself.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from op_count import CountOps
from torch import nn

import ampdoctor
from ampdoctor.core.options import check_audit
from ampdoctor.core.usage import UsageError
from ampdoctor.monitor.numerics import NumericsAudit
from ampdoctor.monitor.parts.numerics_audit import audit_findings
from ampdoctor.monitor.watcher import Watch


def _audit(model: nn.Module, fn, *args) -> list:
    """Audit one forward and backward of ``fn(*args)`` (a loss) on ``model``; return the events."""
    audit = NumericsAudit({m: (n or "(root)") for n, m in model.named_modules()})
    audit.start()   # before the forward: the global hooks see the model's own call
    try:
        fn(*args).backward()
    finally:
        audit.stop()
    return audit.events(audit.pending().tolist() if audit.records else [])


def _kinds(events) -> set[str]:
    return {e.kind for e in events}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, fp32_variance: bool) -> None:
        super().__init__()
        self.weight, self.fp32 = nn.Parameter(torch.ones(dim)), fp32_variance

    def forward(self, x):
        h = x.float() if self.fp32 else x
        variance = h.pow(2).mean(-1, keepdim=True)   # the square overflows fp16 above |x| ~ 256
        return self.weight * (x * torch.rsqrt(variance + 1e-6).to(x.dtype))


@pytest.mark.parametrize("fp32_variance", [False, True])
def test_a_square_overflowing_in_a_frozen_half_norm_is_named_with_its_line(fp32_variance):
    norm = nn.Sequential(RMSNorm(8, fp32_variance)).half().requires_grad_(False)
    x = torch.full((4, 8), 400.0, dtype=torch.float16, requires_grad=True)
    events = _audit(norm, lambda: norm(x).float().sum())
    if fp32_variance:
        assert "nonfinite" not in _kinds(events)
        return
    hit = next(e for e in events if e.kind == "nonfinite")
    assert hit.site.op == "aten.pow.Tensor_Scalar" and hit.site.module == "0" and hit.site.phase == "forward"
    lines = Path(__file__).read_text(encoding="utf-8").splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "variance = h.pow(2)" in text)
    assert hit.site.where.endswith(f"test_numerics.py:{line}") and "65504" in hit.text


@pytest.mark.parametrize("eps", [1e-12, None])
def test_an_eps_that_is_zero_in_fp16_is_named_with_the_nan_it_causes(eps):
    lin = nn.Linear(4, 4).half()
    x = torch.zeros(2, 4, dtype=torch.float16)
    x[1] = 1.0
    with torch.no_grad():
        lin.weight.zero_(), lin.bias.zero_()   # a zero row: its norm is 0

    def loss():
        y = lin(x)
        return F.normalize(y, dim=-1, eps=eps if eps is not None else torch.finfo(y.dtype).tiny).float().sum()
    events = _audit(lin, loss)
    constants = [e for e in events if e.kind == "constant"]
    if eps is None:
        assert constants == []
        return
    assert len(constants) == 1 and constants[0].text.startswith("min=1e-12 is 0 in float16")
    assert constants[0].numbers["nan_after"].startswith("aten.div.Tensor")


def test_a_one_minus_eps_bound_that_rounds_to_one():
    head = nn.Linear(4, 4)
    x = torch.randn(8, 4)
    with torch.no_grad():
        head.bias.fill_(12.0)

    def loss():
        with torch.autocast("cpu", dtype=torch.float16):
            p = torch.sigmoid(head(x)).clamp(1e-4, 1 - 1e-4)
            return -(torch.log(1 - p) * 0 + torch.log(1 - p)).float().mean()
    hit = next(e for e in _audit(head, loss) if e.kind == "constant")
    assert hit.text.startswith("max=0.9999 is 1 in float16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_positions_cast_to_bf16_lose_whole_units(dtype):
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    rot = nn.Linear(4, 4)

    def loss():
        pos = torch.arange(300, dtype=torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            angles = pos[:, None] @ inv[None, :]
            return rot(torch.cos(angles)).float().sum()
    events = _audit(rot, loss)
    integer = [e for e in events if e.kind == "integer"]
    if dtype == torch.float32:
        assert integer == []
        return
    assert integer and "whole numbers (up to 299)" in integer[0].text and "256" in integer[0].text


@pytest.mark.parametrize("in_place", [True, False])
def test_a_matmul_that_bypasses_autocast_costs_fp32(in_place):
    lin = nn.Linear(16, 16)
    x = torch.randn(8, 16)

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if in_place:
                y = torch.zeros(8, 16).addmm_(x, lin.weight.t())
            else:
                y = torch.addmm(torch.zeros(8, 16), x, lin.weight.t())
            return y.float().sum()
    gemm = [e for e in _audit(lin, loss) if e.kind == "fp32-gemm"]
    assert (len(gemm) == 1 and gemm[0].numbers["flops"] == 2 * 8 * 16 * 16) if in_place else gemm == []


class _Recompute(torch.autograd.Function):
    """A reentrant checkpoint that does not keep the autocast state (as hand-written ones did)."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.saved_tensors[0].detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.fn(x)
        torch.autograd.backward(y, grad)
        return None, x.grad


@pytest.mark.parametrize("torch_checkpoint", [False, True])
def test_a_recompute_under_another_autocast_state(torch_checkpoint):
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if torch_checkpoint:
                y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                y = _Recompute.apply(block, x)
        return y.float().sum()   # backward() runs outside autocast
    recompute = [e for e in _audit(block, loss) if e.kind == "recompute"]
    if torch_checkpoint:
        assert recompute == []
        return
    assert [e.site.module for e in recompute] == ["(root)"]   # one finding for the block, not one per child
    found = audit_findings([(0, e) for e in recompute], scaled=False, step_flops={})
    assert [(f.code, f.severity.value) for f in found] == [("AMP708", "error")]
    assert "autocast to bfloat16 (cpu)" in recompute[0].text and "no autocast" in recompute[0].text


def test_a_backward_op_is_named_after_its_forward_op():
    lin = nn.Linear(4, 4).half()
    x = torch.randn(2, 4, dtype=torch.float16)
    audit = NumericsAudit({lin: "lin"})
    audit.start(lin)
    lin(x).float().sum().backward()
    audit.stop()
    backward = [r.site for r in audit.records if r.site.phase == "backward" and r.site.forward]
    assert backward and all(s.where.startswith("tests/monitor/test_numerics.py:") for s in backward)
    addmm = [s for s in backward if s.forward.startswith("aten.addmm")]
    assert addmm and all(s.module == "lin" and s.module_class == "Linear" and s.node == "AddmmBackward0" for s in addmm)


def _train(audit: str, steps: int = 4) -> tuple[list[float], list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    with Watch(model, opt, scaler, every=1, audit=audit):
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    return losses, [t.detach().clone() for t in model.state_dict().values()], torch.get_rng_state()


def test_training_with_the_audit_is_bitwise_identical():
    losses, state, rng = _train("off")
    losses_audited, state_audited, rng_audited = _train("all")
    assert losses == losses_audited and torch.equal(rng, rng_audited)
    assert all(torch.equal(a, b) for a, b in zip(state, state_audited))


def test_steps_it_does_not_audit_run_no_more_ops():
    def ops_of_step_2(audit: str) -> tuple[dict, object]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        counts = {}
        with Watch(model, opt, every=100, dense=0, audit=audit) as watch:
            for step in range(3):
                # counted on the steps after the first (the audit does not start under someone else's mode)
                with CountOps() if step else contextlib.nullcontext() as counter:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(torch.randn(4, 8)).float().sum()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                counts[step] = dict(counter.ops) if step else {}
        return counts, watch.watch_summary().parts.get("audit")
    plain, _ = ops_of_step_2("off")
    audited, section = ops_of_step_2("auto")
    assert section.steps == (0,) and section.ops > 0   # step 0 (sampled) is audited
    assert audited[1] == plain[1] and audited[2] == plain[2]   # the others are not: the same ATen ops


def test_the_audit_does_not_start_under_someone_else_s_mode():
    # a mode entered before the audit's and left while the audit's is on would pop the audit's mode, not its own
    model = nn.Linear(4, 4)
    audit = NumericsAudit({model: "(root)"})
    with CountOps():
        assert audit.start(model) is False and not audit.running
    assert audit.start(model) is True
    audit.stop()


def test_an_error_inside_the_audit_steps_aside_naming_the_op(monkeypatch):
    import ampdoctor.monitor.numerics as numerics

    def broken(*args, **kwargs):
        raise ValueError("boom")
    monkeypatch.setattr(numerics, "_upcast", broken)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with Watch(model, opt, scaler, every=1, audit="all") as watch:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(3, 4)).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    failed = [f for f in watch.findings() if f.code == "AMP001"]
    assert len(failed) == 1 and failed[0].where == "ampdoctor.watch (audit)" and "auditing aten." in failed[0].detail
    assert watch.steps == 2


@pytest.mark.parametrize("given, expected", [("auto", "auto"), ("0,5", (0, 5)), ([3], (3,)), (True, "all"),
                                             (False, "off")])
def test_audit_policies(given, expected):
    assert check_audit(given) == expected


@pytest.mark.parametrize("given", ["sometimes", "-1", "", [1.5]])
def test_a_bad_audit_policy_says_what_it_takes(given):
    with pytest.raises(UsageError, match="takes all, auto, off or step numbers"):
        check_audit(given)


def test_an_fp8_gemm_is_measured_against_the_fp32_matmul_of_its_dequantized_inputs():
    torch.manual_seed(0)
    a, b = torch.randn(16, 32), torch.randn(32, 16)
    scale_a, scale_b = a.abs().max() / 448, b.abs().max() / 448
    audit = NumericsAudit({})
    audit.start()
    a8 = (a / scale_a).to(torch.float8_e4m3fn)
    b8 = (b / scale_b).to(torch.float8_e4m3fn).t().contiguous().t()
    out = torch._scaled_mm(a8, b8, scale_a=scale_a.reshape(()), scale_b=scale_b.reshape(()), out_dtype=torch.bfloat16)
    clipped = (a * 1000).to(torch.float8_e4m3fn)   # an unscaled cast: e4m3fn has no inf, above 448 it clips
    audit.stop()
    records = list(audit.records)
    host = audit.pending().tolist()
    gemm = [(site, ulps) for site, ulps in audit.worst(host, records) if site.op == "aten._scaled_mm.default"]
    assert out.dtype == torch.bfloat16 and len(gemm) == 1
    assert gemm[0][0].dtype == "bfloat16" and gemm[0][1] <= 1.0   # fp32 accumulation: only the output's rounding
    over = [e for e in audit.events(host) if e.kind == "nonfinite"]
    assert clipped.float().abs().max() == 448 and [e.site.op for e in over] == ["aten._to_copy.default"]
    assert "no inf: above it values are clipped" in over[0].text


def test_fp32_ops_against_float64_on_request():
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.bias.fill_(100.0)   # exp(100) is 2.7e43: inf in fp32, finite in float64

    def loss(m):
        return torch.exp(m(torch.zeros(2, 4))).sum()
    plain = ampdoctor.audit(model, loss)
    fp64 = ampdoctor.audit(model, loss, fp32_against_fp64=True)
    assert plain.codes() == [] and fp64.codes() == ["AMP702"]
    assert fp64.findings[0].detail.startswith("aten.exp.default at tests/monitor/test_numerics.py:")
    assert "(forward, float32) gave inf/NaN in 8 entries where float64 gives finite values" in fp64.findings[0].detail
    assert fp64.extra["watch"].parts["audit"].reference == "float64"


def test_audit_outside_a_loop_changes_nothing_the_model_holds():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)).half()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    report = ampdoctor.audit(model, lambda m: m(torch.randn(6, 4).half()).float().pow(2).sum(), steps=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state()) and all(p.grad is None for p in model.parameters())
    assert report.extra["watch"].parts["audit"].steps == (0, 1)


def test_reading_a_saved_python_scalar_under_the_audit():
    # loss * 2.0**16 saves the scalar as a wrapped number: read back as a float (a hand-written loss scaler's
    # factor, read by the loss's part), it reaches the dispatch mode as the float, not a tensor (DeepSpeed runs)
    w = torch.ones(2, requires_grad=True)
    audit = NumericsAudit({})
    audit.start()
    try:
        scaled = w.sum() * 2.0 ** 16
        factor = float(scaled.grad_fn._saved_other)
    finally:
        audit.stop()
    assert factor == 65536.0 and audit.off is False


def test_the_fp32_re_run_of_a_module_runs_nobody_s_hooks_again():
    calls = []
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    model[0].register_forward_hook(lambda *a: calls.append("leaf"))
    model[1][0].register_forward_hook(lambda *a: calls.append("child of a block"))

    def loss(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(torch.randn(3, 4)).float().sum()
    audit = NumericsAudit({m: n or "(root)" for n, m in model.named_modules()})
    audit.start()
    loss(model).backward()
    audit.stop()
    shadowed = {r.site.module for r in audit.records if r.module_output}
    assert calls == ["leaf", "child of a block"]   # once each: the real forward's
    assert shadowed == {"0", "1.0", "1.1"}   # the leaves; not the block "1" (its child's hook would run again)


class _SumPool(nn.Module):
    def forward(self, x):
        total = torch.zeros_like(x[:, 0])
        for i in range(x.shape[1]):   # a running sum in bf16: each addition rounds on its own
            total = total + x[:, i]
        return total


def _bf16(m, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return m(x).float().sum()


@pytest.mark.parametrize("code, model, loss", [
    ("AMP701", nn.Linear(4, 4, bias=False).half(),
     lambda m: F.normalize(m(torch.zeros(2, 4).half())).float().sum()),
    ("AMP702", nn.Linear(4, 4).half(), lambda m: (m(torch.randn(2, 4).half()) * 0 + 300).pow(2).float().sum()),
    ("AMP703", nn.Linear(4, 4).half(),
     lambda m: (m(torch.randn(2, 4).half()) * 0 + torch.tensor([1e-4, 1e-4, 1e4, 1e4]).half()).prod(-1).float().sum()),
    ("AMP704", nn.Linear(4, 4),
     lambda m: _bf16(m, torch.arange(300.0)[:, None].expand(300, 4))),
    ("AMP705", nn.Sequential(nn.Linear(4, 4), nn.Softplus(), _SumPool()), lambda m: _bf16(m, torch.randn(2, 1024, 4))),
    ("AMP706", nn.Linear(4, 4),
     lambda m: _bf16(lambda x: torch.zeros(2, 4).addmm_(x, m.weight.t()), torch.randn(2, 4))),
])
def test_each_audit_finding_of_ampdoctor_audit(code, model, loss):
    torch.manual_seed(0)
    assert code in ampdoctor.audit(model, loss).codes()
