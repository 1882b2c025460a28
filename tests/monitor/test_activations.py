import gc
import json
import time
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampdoctor.core.training import TrainingSetup
from ampdoctor.monitor.activations import ActivationMonitor


class Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class Inner(nn.Module):
    """A container whose own code (not a child) overflows: a(x) * 1e5."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.a(x) * 1e5)


def overflowing_model():
    """0: out 160; 1: weights 1e3 -> 16 * 160 * 1e3 = 2.6e6 > 65504 -> inf; 2: carries inf/NaN along."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    with torch.no_grad():
        model[0].weight.fill_(0.1)
        model[1].weight.fill_(1e3)
    return model


def train_step(model, opt, scaler, x, monitor=None, loss_fn=lambda out: out.float().pow(2).mean()):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    scaler.scale(loss_fn(out)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return monitor.step_record() if monitor is not None else None


def run(model, steps=1, x=None, scaler=None, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = scaler or torch.amp.GradScaler("cpu")
    x = torch.full((4, 16), 100.0) if x is None else x
    monitor = ActivationMonitor(model, setup=TrainingSetup(model, opt, scaler))
    records = []
    with monitor:
        for _ in range(steps):
            records.append(train_step(model, opt, scaler, x, monitor, **kwargs))
    return monitor, records


def codes(monitor):
    return [f.code for f in monitor.findings()]


def hooks_on(model):
    return sum(len(d) for m in model.modules() for d in (
        m._forward_hooks, m._forward_pre_hooks, m._forward_hooks_with_kwargs, m._forward_hooks_always_called,
        m._forward_pre_hooks_with_kwargs, m._backward_hooks, m._backward_pre_hooks))


def global_hooks():
    m = torch.nn.modules.module
    return {name: len(getattr(m, name)) for name in dir(m) if name.startswith("_global_") and name.endswith("hooks")}


# ---- forward -----------------------------------------------------------------------------------------------
def test_names_the_first_module_whose_output_overflows():
    monitor, records = run(overflowing_model())
    assert monitor.first_nonfinite_module == "1"
    assert records[0]["forward"]["nonfinite_module"] == "1"
    [finding] = [f for f in monitor.findings() if f.code == "AMP601"]
    assert finding.where == "1 (Linear)" and finding.step == 0
    first = monitor.summary()["first_nonfinite_forward"]
    assert first["reproduced"] is True
    frames = {f["module"]: {r["role"]: r for r in f["rows"]} for f in first["frames"]}
    assert list(frames) == ["0", "1"]  # frames stop at the culprit; '2' only propagates
    assert frames["0"]["output"]["abs_max"] == pytest.approx(160, rel=1e-2)
    assert frames["1"]["weight"]["abs_max"] == 1e3
    assert frames["1"]["output"]["abs_max"] == "inf"
    assert first["op"]["op"] == "aten.addmm.default" and first["op"]["module"] == "1"
    assert "1.00e+03 1.00e+03 weight" in finding.detail


def test_names_the_module_through_an_activation_checkpoint_wrapper_as_the_model_spells_it():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = overflowing_model()
    model[1] = checkpoint_wrapper(model[1])   # named_modules() says "1._checkpoint_wrapped_module"
    monitor, _ = run(model)
    [finding] = [f for f in monitor.findings() if f.code == "AMP601"]
    assert finding.where == "1 (Linear)", finding.where
    setup = TrainingSetup(model)
    assert [p.name for p in setup.params][2:4] == ["1.weight", "1.bias"]


def test_reports_each_culprit_once_and_keeps_recording():
    monitor, records = run(overflowing_model(), steps=3)
    assert codes(monitor).count("AMP601") == 1
    assert [r["forward"]["nonfinite_module"] for r in records] == ["1", "1", "1"]
    assert monitor.summary()["modules"]["1"]["nonfinite_forward_steps"] == 3


def test_container_own_code_overflow_is_localised_at_the_op_level():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Inner())
    with torch.no_grad():
        model[0].weight.fill_(0.1)
        model[1].a.weight.fill_(0.1)
    monitor, _ = run(model, x=torch.full((4, 16), 1.0))
    assert monitor.first_nonfinite_module == "1.b"  # the first module whose output is inf...
    first = monitor.summary()["first_nonfinite_forward"]
    assert (first["op"]["op"], first["op"]["module"]) == ("aten.mul.Tensor", "1")  # ...but '1' made it inf
    [finding] = [f for f in monitor.findings() if f.code == "AMP601"]
    assert finding.where == "1 (Inner)"


class MaskedAway(nn.Module):
    def forward(self, x):
        return x + (x * 1e5).clamp(max=1.0)  # fp16: 160 * 1e5 -> inf, clamped away: harmless


def test_op_level_search_skips_a_harmless_overflow_in_another_module():
    model = overflowing_model()
    model.insert(1, MaskedAway())  # after '0', whose output is fp16 under autocast
    monitor, _ = run(model)
    assert monitor.first_nonfinite_module == "2"
    first = monitor.summary()["first_nonfinite_forward"]
    assert (first["op"]["op"], first["op"]["module"]) == ("aten.addmm.default", "2")


def test_non_finite_input_data_is_named_as_such():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.ones(2, 4)
    x[0, 0] = float("nan")
    monitor, records = run(model, x=x)
    # bad input, not the first layer's fault: AMP609 on the input, and no AMP601 blaming "0 (Linear)"
    assert codes(monitor) == ["AMP609"]
    [finding] = monitor.findings()
    assert finding.where == "model input" and "before any module ran" in finding.detail
    assert records[0]["forward"]["nonfinite_module"] == "(input)"
    assert monitor.first_nonfinite_module is None
    assert monitor.summary()["first_nonfinite_forward"]["module"] == "(input)"


# ---- backward ----------------------------------------------------------------------------------------------
def test_backward_overflow_from_the_loss_names_the_last_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    # init_scale 2**20: the scaled gradient of the output, 2**20 / 64 per element... times 2*out, overflows fp16
    monitor, records = run(model, x=torch.randn(4, 16), scaler=torch.amp.GradScaler("cpu", init_scale=2.0**30),
                           loss_fn=lambda out: out.float().sum())
    assert records[0]["forward"]["nonfinite_module"] is None
    assert "AMP601" not in codes(monitor)
    [finding] = [f for f in monitor.findings() if f.code == "AMP602"]
    assert finding.where == "2 (Linear)"
    assert "straight from the loss" in finding.detail
    assert monitor.first_nonfinite_module == "2"


def test_backward_overflow_in_the_middle_names_the_module_whose_output_gradient_overflowed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    with torch.no_grad():
        model[0].weight.fill_(0.01)
        model[2].weight.fill_(100.0)  # forward: |out2| <= 16 * 0.5 * 100 = 800, finite
    # backward: d out2 = 1000 (finite); d out1 = 1000 * 16 * 100 = 1.6e6 > 65504 -> inf
    monitor, records = run(model, x=torch.ones(4, 16), scaler=torch.amp.GradScaler("cpu", init_scale=1000.0),
                           loss_fn=lambda out: out.float().sum())
    assert records[0]["forward"]["nonfinite_module"] is None
    assert records[0]["backward"]["nonfinite_module"] == "1"
    [finding] = [f for f in monitor.findings() if f.code == "AMP602"]
    assert finding.where == "1 (Linear)"
    assert monitor.summary()["first_nonfinite_backward"]["upstream"] == "2"
    assert "GradScaler's scale" in finding.detail


# ---- headroom ----------------------------------------------------------------------------------------------
def headroom_model(factor):
    model = nn.Sequential(nn.Linear(16, 16), Scale(factor))
    with torch.no_grad():
        model[0].weight.fill_(0.1)
        model[0].bias.zero_()
    return model


def forward_only(model, x, dtype=torch.float16):
    monitor = ActivationMonitor(model)
    with monitor, torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        model(x)
        record = monitor.step_record()
    return monitor, record


def test_headroom_flags_activations_near_the_fp16_maximum_before_they_overflow():
    monitor, record = forward_only(headroom_model(2000.0), torch.full((4, 16), 10.0))  # 16 * 2000 = 32000
    assert record["forward"]["nonfinite_module"] is None
    [finding] = [f for f in monitor.findings() if f.code == "AMP606"]
    assert finding.where == "1 (Scale)"  # not the root, which only returns Scale's output
    assert "32000" in finding.detail and "65504" in finding.detail
    assert monitor.summary()["modules"]["1"]["headroom_ratio"] == pytest.approx(32000 / 65504, rel=1e-3)


def test_headroom_quiet_on_a_normal_model_and_under_bf16():
    torch.manual_seed(0)
    monitor, _ = forward_only(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(8, 16))
    assert monitor.findings() == []
    monitor, _ = forward_only(headroom_model(2000.0), torch.full((4, 16), 10.0), dtype=torch.bfloat16)
    assert monitor.findings() == []


# ---- do no harm --------------------------------------------------------------------------------------------
class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x):
        return x * self.gain


def harm_model():
    # the overflow comes after BatchNorm, so its running statistics stay finite and a re-run that forgot to
    # restore them would show; Dropout shows a re-run that drew from the user's RNG
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), Gain(), nn.Linear(32, 4))


def bits(t):
    return t.detach().reshape(-1).view(torch.uint8) if t.is_floating_point() else t


def train_20_steps(watch, mode="recorded"):
    torch.manual_seed(0)
    model = harm_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    data = torch.Generator().manual_seed(1)
    monitor = ActivationMonitor(model).attach() if watch else None
    outputs = []
    for step in range(20):
        x = torch.randn(16, 8, generator=data)
        model[4].gain.fill_(1e6 if step in (5, 12) else 1.0)  # these steps overflow fp16
        if monitor is not None and mode == "driven":
            monitor.set_sampling(step % 2 == 1)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        outputs.append(out.detach().clone())
        scaler.scale(out.float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if monitor is not None and mode != "auto":  # "auto": recorded, and re-run, inside the next forward
            monitor.step_record()
    if monitor is not None:
        monitor.detach()
    state = {**model.state_dict(), "rng": torch.get_rng_state()}
    return state, outputs, scaler.get_scale(), monitor


@pytest.mark.parametrize("mode", ["recorded", "auto", "driven"])
def test_training_is_bitwise_identical_with_the_monitor(mode):
    plain, plain_out, plain_scale, _ = train_20_steps(watch=False)
    watched, watched_out, watched_scale, monitor = train_20_steps(watch=True, mode=mode)
    first = monitor.summary()["first_nonfinite_forward"]
    assert first["frames"]  # a re-run did happen, through Dropout and BatchNorm
    # "auto" re-runs inside step 6's forward, under the user's autocast, where gain is back to 1; on torch without
    # the fix for pytorch#112583 (PR #165068), no_grad casts left in autocast's weight cache cut step 6's weights
    # off from their gradients, which the re-run's cache_enabled=False prevents
    assert first["reproduced"] is (mode != "auto")
    assert monitor.first_nonfinite_module == "4"  # fp16 * 1e6 overflows in Gain itself
    assert plain_scale == watched_scale < 2.0**10  # skipped steps
    assert plain.keys() == watched.keys()
    for key in plain:
        assert torch.equal(bits(plain[key]), bits(watched[key])), key
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(plain_out, watched_out))
    assert all(torch.isfinite(plain[k]).all() for k in plain if k.startswith("1.running"))


def test_detach_removes_every_hook_including_global_ones():
    before = global_hooks()
    model = overflowing_model()
    assert hooks_on(model) == 0
    monitor, _ = run(model)  # overflow: frame and op-level re-runs registered hooks too
    assert monitor.summary()["first_nonfinite_forward"]["op"] is not None
    assert hooks_on(model) == 0 and not monitor.enabled
    assert global_hooks() == before
    monitor.attach()
    assert sum(len(m._forward_hooks) for m in model.modules()) == len(list(model.modules()))
    assert len(model._forward_pre_hooks) == 1
    monitor.detach()
    assert hooks_on(model) == 0


def test_hooks_never_change_outputs():
    model = overflowing_model()
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        plain = model(x)
        with ActivationMonitor(model):
            watched = model(x)
    assert torch.equal(plain, watched)


@pytest.mark.parametrize("detach", [True, False])
def test_monitor_does_not_keep_the_model_alive(detach):
    model = overflowing_model()
    monitor, _ = run(model, steps=2)
    if not detach:
        monitor.attach()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert monitor.summary()["first_nonfinite_module"] == "1"


def test_inputs_of_a_sampled_step_are_released_when_it_is_recorded():
    model = nn.Sequential(nn.Linear(16, 16))
    x = torch.randn(2, 16)
    ref = weakref.ref(x)
    with ActivationMonitor(model) as monitor:
        model(x).sum().backward()
        del x
        assert ref() is not None  # kept for a possible re-run until the step is recorded
        monitor.step_record()
        assert ref() is None


class ExplodingMonitor(ActivationMonitor):
    def _forward_stats(self, index, output):
        raise RuntimeError("injected fault")


def test_internal_error_is_reported_once_and_the_monitor_steps_aside():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    monitor = ExplodingMonitor(model).attach()
    for _ in range(3):
        record = train_step(model, opt, scaler, torch.randn(8, 16), monitor)
    assert codes(monitor) == ["AMP001"]
    assert "injected fault" in monitor.findings()[0].detail
    assert not monitor.enabled and hooks_on(model) == 0
    assert record["sampled"] is False
    assert monitor.summary()["error"] == "RuntimeError: injected fault"


def test_internal_error_while_recording_is_caught(monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4))

    def broken(self, step):
        raise ValueError("cannot record")

    monkeypatch.setattr(ActivationMonitor, "_close", broken)
    with ActivationMonitor(model) as monitor:
        model(torch.ones(1, 4)).sum().backward()
        monitor.step_record()
        model(torch.ones(1, 4)).sum().backward()  # training goes on
    assert codes(monitor) == ["AMP001"]


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_an_inactive_monitor_runs_no_tensor_op():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 16)

    def ops():
        with CountOps() as counter:
            model(x).sum().backward()
        return counter.count

    baseline = ops()
    monitor = ActivationMonitor(model).attach()
    monitor.set_sampling(False)
    assert ops() == baseline
    monitor.set_sampling(True)
    assert ops() > baseline
    monitor.detach()


def test_every_samples_every_nth_root_call():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with ActivationMonitor(model, every=3) as monitor:
        for _ in range(7):  # calls 0, 3 and 6 are sampled
            model(torch.ones(1, 4))
    assert monitor.summary()["sampled_steps"] == 3


def test_records_and_summary_are_json_ready():
    monitor, records = run(overflowing_model(), steps=2)
    for data in [*records, monitor.summary()]:
        json.dumps(data, allow_nan=False)


def test_rejects_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        ActivationMonitor("model")
    with pytest.raises(ValueError, match="every"):
        ActivationMonitor(nn.Linear(2, 2), every=0)


def test_overhead_on_a_small_transformer():
    """Print (not assert) the step time with the monitor sampling every step vs without; CPU time, 1 thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.1, batch_first=True)
        model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(128, 128))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cpu")
        x = torch.randn(8, 32, 128)
        monitor = ActivationMonitor(model).attach()

        def step(active):
            monitor.set_sampling(active)
            start = time.process_time()
            train_step(model, opt, scaler, x, monitor if active else None)
            return time.process_time() - start

        times = {True: [], False: []}
        for i in range(12):  # interleaved, so that load from other processes hits both alike
            times[i % 2 == 0].append(step(i % 2 == 0))
        monitor.detach()
        base, active = (sorted(times[k])[len(times[k]) // 2] for k in (False, True))
        print(f"\nActivationMonitor overhead: {active / base:.2f}x ({active * 1e3:.1f} ms vs {base * 1e3:.1f} ms)")
        assert not monitor.findings()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_hooks_never_sync_and_the_culprit_is_named():
    model = overflowing_model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.full((4, 16), 100.0, device="cuda")
    monitor = ActivationMonitor(model).attach()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in forward or backward raises
    try:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        scaler.scale(out.float().pow(2).mean()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    scaler.step(opt)
    scaler.update()
    record = monitor.step_record()
    monitor.detach()
    assert record["forward"]["nonfinite_module"] == "1"
    first = monitor.summary()["first_nonfinite_forward"]
    assert first["reproduced"] and first["op"]["module"] == "1"


def test_a_sampled_step_is_read_in_one_host_read_and_an_unsampled_one_in_none():
    from ampdoctor.core.host_reads import HostReads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    reads = HostReads("test")
    monitor = ActivationMonitor(model, every=2, reads=reads).attach()
    counts, records = [], []
    for _ in range(4):   # calls 0 and 2 are sampled
        model(torch.randn(3, 4, requires_grad=True)).sum().backward()
        before = reads.count
        records.append(monitor.step_record())
        counts.append(reads.count - before)
    monitor.detach()
    assert [r["sampled"] for r in records] == [True, False, True, False]
    assert records[0]["forward"]["values"] == 5   # the input, the three layers and the Sequential
    assert counts == [1, 0, 1, 0] and monitor.reads.count == reads.count == 2


def test_the_batched_read_of_both_directions_gives_what_one_read_per_direction_gives():
    from ampdoctor.core.host_reads import HostReads
    from ampdoctor.monitor.activation_records import abs_max

    fwd = [torch.aminmax(torch.tensor([-3.0, 2.0], dtype=torch.float16)), torch.aminmax(torch.tensor([float("inf")]))]
    bwd = [torch.aminmax(torch.tensor([0.5, -0.25], dtype=torch.bfloat16))]
    reads = HostReads("test")
    together = abs_max(fwd, bwd, reads=reads)
    assert reads.count == 1
    assert together == [abs_max(fwd)[0], abs_max(bwd)[0]] == [[3.0, float("inf")], [0.5]]


def test_the_runs_other_models_are_looked_at_in_call_order():
    """A generator's overflow reaches the watched critic as input: with the run's other models the first inf in
    call order is the generator's layer (re-run from its own recorded call), and the critic's input is no bad data.
    An input that no module made non-finite is still the data's (AMP609 on that model's input)."""
    gen, critic = overflowing_model(), nn.Sequential(nn.Linear(16, 4), nn.ReLU())
    monitor = ActivationMonitor(critic, prefix="critic.", others=[(gen, "gen."), (nn.Linear(2, 2), "gone.")])
    with monitor, torch.autocast("cpu", dtype=torch.float16):
        monitor.set_sampling(True)   # as a watch drives it: the generator runs before the critic's call
        critic(gen(torch.full((2, 16), 100.0)))
        record = monitor.step_record()
    assert codes(monitor) == ["AMP601"] and monitor.first_nonfinite_module == "gen.1"
    assert record["forward"]["nonfinite_module"] == "gen.1" and record["forward"]["inputs"]
    assert monitor.summary()["first_nonfinite_forward"]["op"]["module"] == "gen.1"
    assert {"gen.0", "gen.1", "critic.0"} <= set(monitor.summary()["modules"])

    monitor = ActivationMonitor(critic, prefix="critic.", others=[(gen, "gen.")])
    x = torch.ones(2, 16)
    x[0, 0] = float("nan")
    with monitor:
        monitor.set_sampling(True)
        critic(gen(x))
        record = monitor.step_record()
    assert codes(monitor) == ["AMP609"] and record["forward"]["nonfinite_module"] == "(input of gen)"
    [finding] = monitor.findings()
    assert finding.where == "gen input" and "an input tensor of gen holds NaN" in finding.detail


def test_a_root_collected_last_is_left_out_of_the_input_finding():
    critic = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    monitor = ActivationMonitor(critic, others=[(nn.Linear(2, 2), "gone.")])   # collected after construction
    x = torch.ones(2, 4)
    x[0, 0] = float("nan")
    with monitor:
        monitor.set_sampling(True)
        critic(x)
        monitor.step_record()
    [finding] = monitor.findings()
    assert finding.code == "AMP609" and finding.where == "model input" and "before any module ran" in finding.detail
