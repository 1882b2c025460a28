import math

import pytest
import torch
from torch import nn

from ampdoctor.monitor.op_replay import NonfiniteOpTracer, first_nonfinite_op

INF = float("inf")


class Blowup(nn.Module):
    """Several ops; only exp overflows fp16 (exp(20) ≈ 4.9e8 > 65504)."""

    def forward(self, x):
        h = x * 1e3  # 0.02 -> 20: finite
        h = h.exp()  # inf
        h = h - 1  # carries inf along
        return h * 0  # inf * 0 = NaN, from an input that already holds inf


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), Blowup())

    def forward(self, x):
        return self.body(x)


def _global_hook_counts():
    m = torch.nn.modules.module
    return {name: len(getattr(m, name)) for name in dir(m) if name.startswith("_global_") and name.endswith("hooks")}


def test_names_the_op_that_overflows_and_its_module_path():
    net = Net().half()
    with torch.no_grad():
        net.body[0].weight.zero_()
        net.body[0].bias.fill_(0.02)
    found = first_nonfinite_op(net, torch.ones(2, 4, dtype=torch.float16))
    assert found.op == "aten.exp.default"
    assert found.kind == "inf"
    assert (found.module, found.module_class) == ("body.1", "Blowup")
    assert found.module_stack == ("(root)", "body", "body.1")
    assert all(math.isfinite(s.abs_max) for s in found.inputs)
    assert found.inputs[0].abs_max == pytest.approx(20, rel=1e-2)
    assert found.outputs[0].abs_max == INF
    assert "aten.exp.default" in found.describe() and "'body.1' (Blowup)" in found.describe()


def test_names_the_overflowing_matmul_under_cpu_autocast():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    with torch.no_grad():
        model[0].weight.fill_(0.1)
        model[1].weight.fill_(1e3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        found = first_nonfinite_op(model, torch.full((4, 16), 100.0))
    assert found.op == "aten.addmm.default"
    assert found.module == "1"
    assert [s.role for s in found.inputs] == ["self", "mat1", "mat2"]


def test_finds_nan_made_from_inf_outside_modules():
    found = first_nonfinite_op(lambda t: (t - t).sum(), torch.tensor([INF, 1.0]))
    assert (found.op, found.kind, found.module) == ("aten.sub.Tensor", "nan", "(outside any module)")


def test_finds_an_in_place_overflow_by_measuring_its_input_first():
    x = torch.full((3,), 100.0, dtype=torch.float16)
    found = first_nonfinite_op(lambda t: t.clone().mul_(1e3).add_(1), x)
    assert found.op == "aten.mul_.Tensor"
    assert found.inputs[0].abs_max == 100


def test_quiet_on_finite_code_and_on_deliberate_minus_inf_masks():
    def attention_like(scores):
        mask = torch.ones(4, 4).tril().bool()
        return scores.masked_fill(~mask, -INF).softmax(-1)  # every row keeps the diagonal: no NaN

    assert first_nonfinite_op(attention_like, torch.randn(4, 4)) is None
    assert first_nonfinite_op(nn.Linear(4, 4), torch.randn(2, 4)) is None


def test_fully_masked_row_is_found_as_the_nan_origin():
    scores = torch.randn(2, 3)
    found = first_nonfinite_op(lambda s: s.masked_fill(torch.tensor([[True] * 3, [False] * 3]), -INF).softmax(-1),
                               scores)
    assert found.op == "aten._softmax.default" and found.kind == "nan"


def test_modules_outside_fn_are_named_like_module_tracker():
    seq = nn.Sequential(nn.Identity(), Blowup()).half()
    found = first_nonfinite_op(lambda x: seq(x), torch.full((2,), 0.02, dtype=torch.float16))
    assert found.module == "Sequential.1"


def test_removes_its_global_hooks_even_when_fn_raises():
    before = _global_hook_counts()

    def broken(x):
        nn.Linear(2, 2)(x)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        first_nonfinite_op(broken, torch.ones(1, 2))
    first_nonfinite_op(nn.Linear(2, 2), torch.ones(1, 2))
    assert _global_hook_counts() == before


def test_to_dict_is_json_ready():
    import json

    found = first_nonfinite_op(lambda t: t.exp(), torch.full((2,), 20.0, dtype=torch.float16))
    data = json.loads(json.dumps(found.to_dict(), allow_nan=False))
    assert data["op"] == "aten.exp.default" and data["outputs"][0]["abs_max"] == "inf"


class MaskedAway(nn.Module):
    """Overflows, then throws the inf away: harmless."""

    def forward(self, x):
        big = (x * 1e7).clamp(max=1.0)  # fp16: 0.02 * 1e7 -> inf, clamped back to 1
        return x + big


def test_within_looks_only_inside_the_named_module():
    net = nn.Sequential(MaskedAway(), Blowup()).half()
    x = torch.full((2,), 0.02, dtype=torch.float16)
    assert first_nonfinite_op(net, x).module == "0"  # the harmless overflow comes first
    with NonfiniteOpTracer(net, within="1") as tracer:
        net(x)
    assert (tracer.found.op, tracer.found.module) == ("aten.exp.default", "1")
