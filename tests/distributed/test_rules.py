"""Distributed rules on real torch.distributed (gloo, CPU): FSDP reduction dtypes (AMP210), rank-local skip decisions
(AMP211, AMP411), a rank with no local shard (AMP406), MasterWeights and --fix under real DDP, and Megatron-LM /
apex (AMP212; DeepSpeed runs for real on the CPU: ``test_deepspeed.py``).

Megatron-LM and apex are not run here: apex is not on PyPI, and both build their mixed-precision optimizers on CUDA
kernels. Their objects are minimal stand-in classes defined here under the real module names
(``megatron.core.optimizer``...), registered in ``sys.modules`` for one test, with the attributes those engines
really have. torch itself
is never mocked: the models, optimizers, GradScalers, process groups, FSDP and DDP are real.
"""

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch_jobs import teardown_abort
from torch import nn

from ampdoctor.core.report import Report
from ampdoctor.core.training import TrainingSetup
from ampdoctor.preflight.engine import check, run_preflight
from ampdoctor.ranks.merge import rank_disagreements
from ampdoctor.repairs.master_weights import MasterWeights
from ampdoctor.repairs.upcast import fix, upcast_trainable_params_
from ampdoctor.session.repair import RunRepairs

SCRIPTS = Path(__file__).parent / "rule_scripts"
ROOT = Path(__file__).parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), **extra}


# ---- two ranks: FSDP1 / FSDP2 and the scalers (one run of the script, read by the tests below) -------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    codes, logs = _launch_two_ranks(out)
    if any(teardown_abort(code, log) for code, log in zip(codes, logs)):   # torch's, see tests/launch_jobs.py
        codes, logs = _launch_two_ranks(out)
    assert codes == [0, 0], "\n".join(logs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _launch_two_ranks(out: Path) -> tuple[list[int], list[str]]:
    port = str(_port())
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "fsdp_rules.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=_env(RANK=str(r), WORLD_SIZE="2", PORT=port, OUT=str(out))) for r in range(2)]
    try:
        logs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], logs


def _codes(ranks, case):
    return [[(code, severity) for code, severity, _ in rank[case]] for rank in ranks]


def test_amp210_fires_for_fp16_and_bf16_reductions_over_two_ranks(two_ranks):
    assert _codes(two_ranks, "fsdp1_fp16_reduce_default") == [[("AMP210", "warning")]] * 2
    assert _codes(two_ranks, "fsdp2_fp16_default_plain_scaler") == [[("AMP210", "warning")]] * 2
    assert _codes(two_ranks, "fsdp2_bf16_default") == [[("AMP210", "info")]] * 2
    detail = two_ranks[0]["fsdp1_fp16_reduce_default"][0][2]
    assert "over 2 ranks in float16" in detail and "defaults to param_dtype" in detail and "sqrt(2)" in detail


def test_amp210_quiet_when_reduce_dtype_is_fp32(two_ranks):
    assert _codes(two_ranks, "fsdp1_fp32_reduce") == [[], []]
    assert _codes(two_ranks, "fsdp2_fp32_reduce_plain_scaler") == [[], []]


def test_amp208_fires_for_fsdp_fp16_compute_with_nothing_to_scale_the_loss(two_ranks):
    for case in ("fsdp1_fp16_no_scaler", "fsdp1_fp16_disabled_scaler", "fsdp2_fp16_no_scaler"):
        assert _codes(two_ranks, case) == [[("AMP208", "warning")]] * 2, case
    fsdp1 = two_ranks[0]["fsdp1_fp16_no_scaler"][0][2]
    assert fsdp1.startswith("1 FSDP unit computes in float16 (FSDP(mixed_precision=MixedPrecision("
                            "param_dtype=float16)): (root)) and no enabled GradScaler scales the loss (no GradScaler)")
    assert "ShardedGradScaler" in fsdp1
    assert "(ShardedGradScaler('cpu') is disabled)" in two_ranks[0]["fsdp1_fp16_disabled_scaler"][0][2]
    fsdp2 = two_ranks[0]["fsdp2_fp16_no_scaler"][0][2]
    assert fsdp2.startswith("2 FSDP units compute in float16 (fully_shard(mp_policy=MixedPrecisionPolicy("
                            "param_dtype=float16)): (root), 0)")


def test_amp208_quiet_with_a_sharded_scaler_or_without_fp16_compute(two_ranks):
    for case in ("fsdp1_fp16_sharded_scaler", "fsdp1_fp32_no_scaler", "fsdp2_bf16_no_scaler"):
        assert _codes(two_ranks, case) == [[], []], case


def test_amp211_fires_for_fsdp1_with_a_plain_gradscaler(two_ranks):
    assert _codes(two_ranks, "fsdp1_fp32_plain_scaler") == [[("AMP211", "error")]] * 2
    # fp16 FSDP1 units under a plain scaler stay AMP205's
    assert _codes(two_ranks, "fsdp1_fp16_plain_scaler") == [[("AMP205", "error")]] * 2


def test_amp211_quiet_for_sharded_scaler_no_shard_and_fsdp2(two_ranks):
    assert _codes(two_ranks, "fsdp1_fp32_sharded_scaler") == [[], []]
    assert _codes(two_ranks, "fsdp1_no_shard_plain_scaler") == [[], []]   # all-reduced, like DDP
    assert ("AMP211", "error") not in _codes(two_ranks, "fsdp2_fp16_default_plain_scaler")[0]   # DTensor: MAX


def test_amp411_the_ranks_of_a_plain_scaler_really_disagree(two_ranks):
    records = {r: rank["skips_plain_scaler"] for r, rank in enumerate(two_ranks)}
    assert records[0]["skipped_steps"] == [1] and records[1]["skipped_steps"] == []   # the premise, really run
    [finding] = rank_disagreements(records)
    assert finding.code == "AMP411" and finding.step == 1
    assert "rank 0 skipped the step while rank 1 applied it" in finding.detail
    assert "rank 0 32768, rank 1 65536" in finding.detail


def test_amp411_quiet_when_a_sharded_scaler_keeps_the_ranks_together(two_ranks):
    records = {r: rank["skips_sharded_scaler"] for r, rank in enumerate(two_ranks)}
    assert records[0]["skipped_steps"] == records[1]["skipped_steps"] == [1]
    assert rank_disagreements(records) == []


def test_amp406_names_the_rank_without_a_local_shard(two_ranks):
    rank0, rank1 = (rank["no_shard_plain_scaler"] for rank in two_ranks)
    assert rank0 == []   # rank 0 holds the weight and steps
    assert rank1[-1][2] == "AssertionError: No inf checks were recorded for this optimizer."
    [amp406] = [detail for code, _, detail in rank1 if code == "AMP406"]
    assert "on rank 1 of 2" in amp406 and "no local shard" in amp406 and "ShardedGradScaler" in amp406


def test_amp406_quiet_with_a_sharded_scaler(two_ranks):
    assert [rank["no_shard_sharded_scaler"] for rank in two_ranks] == [[], []]


# ---- one rank: real DDP ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def process_group():
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_port()}")
    yield
    dist.destroy_process_group()


def _half():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).half()


def test_the_watch_reads_a_sharded_grad_scaler_and_a_step_it_skipped(process_group):
    # ShardedGradScaler keeps its inf flags as shape-(1,) tensors, not GradScaler's (): copying one into the
    # watch's row raised (AMP001), the loss-scale part went off, and the inf gradients of the skipped first step
    # were then reported as "not skipped" (AMP608).
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    import ampdoctor

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu")
    assert scaler.get_scale() == 65536.0
    with ampdoctor.watch(model, opt, scaler, every=1) as watch:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(2, 4)).float().sum()   # inf gradients at 65536 and at 32768
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert [f.code for f in watch.findings()] == []
    scale = watch.summary_data()["scale"]
    assert scale["skipped_steps"] == [0, 1] and scale["current"] == scaler.get_scale() == 16384.0, scale


def test_master_weights_refuses_a_ddp_model(process_group):
    ddp = nn.parallel.DistributedDataParallel(_half())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"DistributedDataParallel .*torch\.autocast.*before wrapping"):
        MasterWeights(opt)
    assert all(p.dtype == torch.float16 for p in ddp.parameters())


def test_master_weights_quiet_for_a_bare_model_while_a_process_group_runs(process_group):
    model = _half()
    master = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(master.masters) == 4
    master.detach()


def test_upcast_refuses_the_model_inside_a_ddp_wrapper(process_group):
    inner = _half()
    ddp = nn.parallel.DistributedDataParallel(inner)
    with pytest.raises(ValueError, match="wrapped in DistributedDataParallel"):
        upcast_trainable_params_(inner)   # the names users know: ampdoctor run hands over the inner module
    assert all(p.dtype == torch.float16 for p in ddp.parameters())


def test_upcast_before_wrapping_then_ddp_trains(process_group):
    model = _half()
    assert len(fix(model)) == 4
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ddp(torch.ones(2, 4)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in ddp.parameters())


def test_run_repairs_refuse_a_ddp_model_and_change_nothing(process_group):
    inner = _half()
    ddp = nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    report, events = Report(), []
    for autocast in (None, torch.float16):   # fp32 master weights, then an upcast: both refused
        RunRepairs(report, events.append).apply(TrainingSetup(inner, opt), [inner], {id(inner): autocast})
    assert report.changes == [] and all(p.dtype == torch.float16 for p in inner.parameters())
    assert len(report.extra["fix_refused"]) == 1
    assert events[0].startswith("ampdoctor --fix refused: the model is wrapped")
    ddp(torch.ones(2, 4, dtype=torch.float16)).float().sum().backward()   # the reducer still works
    assert all(p.grad.dtype == torch.float16 for p in inner.parameters())


def test_run_fix_on_a_ddp_script_refuses_and_the_script_trains():
    result = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--fix", "--no-watch",
                             str(SCRIPTS / "ddp_half.py")], capture_output=True, text=True, timeout=180, env=_env())
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("ampdoctor --fix refused: the model is wrapped in DistributedDataParallel") == 1
    assert "master weight added" not in result.stderr
    assert result.stdout.count("weight torch.float16") == 3


# ---- Megatron-LM, apex: stand-ins for engines that do not run here (DeepSpeed is real: test_deepspeed.py) -------
def _install(monkeypatch, module: str, *classes: type) -> None:
    """Register ``classes`` under ``module`` (and its parents) in sys.modules, for this test only."""
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for cls in classes:
        cls.__module__ = module
        setattr(sys.modules[module], cls.__name__, cls)


def test_amp212_megatron_optimizer_found_behind_its_torch_optimizer(monkeypatch):
    class MixedPrecisionOptimizer:   # megatron/core/optimizer/optimizer.py
        pass

    class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
        def __init__(self, params, inner):
            self.float16_groups = [list(params)]
            self.optimizer = inner
            self.config = types.SimpleNamespace(fp16=False, bf16=True)

        def get_loss_scale(self):
            return torch.tensor(1.0)

    _install(monkeypatch, "megatron.core.optimizer.optimizer", MixedPrecisionOptimizer,
             Float16OptimizerWithFloat16Params)
    model = _half().bfloat16()
    main = [nn.Parameter(p.detach().float()) for p in model.parameters()]   # fp32 main params
    megatron = Float16OptimizerWithFloat16Params(model.parameters(), torch.optim.Adam(main))
    # ampdoctor run sees the model and the torch optimizer; the wrapper is found in the gc scan
    findings = run_preflight(TrainingSetup(model, megatron.optimizer, autocast_dtype=torch.bfloat16))
    assert [f.code for f in findings] == ["AMP212"]
    assert "Megatron-LM" in findings[0].detail and "bf16 enabled" in findings[0].detail


def test_amp212_apex_fp16_optimizer(monkeypatch):
    class FP16_Optimizer:   # apex/fp16_utils/fp16_optimizer.py
        def __init__(self, inner, params):
            self.fp16_groups = [list(params)]
            self.fp32_from_fp16_groups = [inner.param_groups[0]["params"]]
            self.optimizer = inner
            self.dynamic_loss_scale = True
            self.loss_scaler = types.SimpleNamespace(cur_scale=1024.0)

    _install(monkeypatch, "apex.fp16_utils.fp16_optimizer", FP16_Optimizer)
    model = _half()
    apex = FP16_Optimizer(torch.optim.SGD([nn.Parameter(p.detach().float()) for p in model.parameters()], lr=0.1),
                          model.parameters())
    report = check(model, apex)
    assert report.codes() == ["AMP212"]
    assert "dynamic loss scale" in report.findings[0].detail and "current loss scale 1024" in report.findings[0].detail


def test_amp212_quiet_without_an_engine_and_the_fp32_copies_are_flagged_then():
    # the same fp32 copies with no engine owning them really are stale tensors: AMP301/AMP302 stay on
    model = _half()
    opt = torch.optim.SGD([nn.Parameter(p.detach().float()) for p in model.parameters()], lr=0.1)
    codes = check(model, opt).codes()
    assert "AMP212" not in codes and {"AMP301", "AMP302"} <= set(codes)
