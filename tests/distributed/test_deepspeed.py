"""ampdoctor on the real DeepSpeed, on the CPU (``DS_ACCELERATOR=cpu``, gloo): ZeRO stages 0, 2 and 3 in bf16.

What is shown, each on a real ``deepspeed.initialize`` engine (``scripts/deepspeed_train.py``):
- AMP212 says what the engine's config says, and nothing it does not: bf16 scales no loss;
- one finding per engine, also under ZeRO-3 (whose offload and ``zero.Init`` helpers are parts of the engine);
- the watch names the fp32 flat copy the engine's optimizer steps, and under ZeRO-2 on two ranks merges the
  partitions into the statistics of the whole gradient: the same numbers as one process;
- under ZeRO-3 the watch says that it read no gradient, and why;
- ``check()``, ``fix()``, ``upcast_trainable_params_`` and ``run --fix`` on the engine: AMP212 alone, and a
  refusal that changes nothing;
- training under ``ampdoctor run`` is bitwise the same as without it;
- accelerate's DeepSpeed plugin: the watch goes through accelerate's and DeepSpeed's optimizer wrappers.

fp16 is not run: DeepSpeed refuses it on a CPU ("Type fp16 is not supported on your device").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launch_jobs import clean_environment, free_port, run_job

pytest.importorskip("deepspeed", reason="needs deepspeed (the test extra installs it)")

SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_train.py"
ACCELERATE = Path(__file__).parent / "scripts" / "accelerate_deepspeed_train.py"


def _env(**extra: str) -> dict[str, str]:
    return clean_environment(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **extra)


def _single(tmp_path: Path, *args: str, ampdoctor: list[str] | None = None, script: Path = SCRIPT,
            **extra: str) -> tuple[str, dict | None]:
    """Run a script as one process (the rendezvous variables a launcher would set); return its output and JSON."""
    env = _env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               **extra)
    report = tmp_path / "report.json"
    head = [sys.executable, "-m", "ampdoctor", "run", "--json", str(report), *(ampdoctor or [])] \
        if ampdoctor is not None else [sys.executable]
    code, out = run_job([*head, str(script), *args], tmp_path, env, timeout=240)
    assert code == 0, out[-4000:]
    return out, json.loads(report.read_text()) if ampdoctor is not None else None


def _losses(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("step ")]


@pytest.fixture(scope="module")
def zero2(tmp_path_factory) -> tuple[str, dict]:
    """ZeRO-2 in bf16 under ``ampdoctor run --fix``, one process, without clipping."""
    return _single(tmp_path_factory.mktemp("zero2"), "--stage", "2", ampdoctor=["--fix"])


def test_amp212_says_what_the_bf16_config_says_training_is_unchanged_and_fix_refuses(zero2, tmp_path):
    out, report = zero2
    assert [f["code"] for f in report["findings"]] == ["AMP212"]
    detail = report["findings"][0]["detail"]
    for said in ("DeepSpeed", "bf16 enabled", "ZeRO stage 2", "AdamW", "bf16 needs no loss scale",
                 "6 model parameters"):
        assert said in detail, detail
    for unsaid in ("dynamic loss scale", "current loss scale", "OVERFLOW"):   # bf16 scales no loss
        assert unsaid not in detail, detail
    plain, _ = _single(tmp_path, "--stage", "2", "--check")
    assert _losses(out) == _losses(plain) and len(_losses(plain)) == 4
    # check() and fix() on the same real engine, after training: AMP212 alone, and a refusal that changes nothing
    said = json.loads(next(line for line in plain.splitlines() if line.startswith("CHECK "))[6:])
    assert said["check"] == said["check_inner"] == ["AMP212"]   # no false AMP1xx-AMP3xx on its fp32 partitions
    assert "is a DeepSpeed engine" in said["fix"] and "belong to DeepSpeed" in said["upcast"]
    assert said["dtypes"] == ["torch.bfloat16"]
    # --fix under ampdoctor run: refused once, nothing changed (the losses above are bitwise the plain ones)
    assert report["changes"] == [] and out.count("ampdoctor --fix refused: these parameters belong to DeepSpeed") == 1


GROUPS = [f"DeepSpeedZeroOptimizer.single_partition_of_fp32_groups[{i}]" for i in (0, 1)]


def test_the_watch_names_the_fp32_copies_and_counts_engine_steps(zero2):
    # DeepSpeed steps the torch optimizer once per parameter group, with only that group's partition holding a
    # gradient: the watch counted 8 steps for 4, and read one group's gradient per sampled "step"
    out, report = zero2
    watch = report["watch"]
    assert list(watch["gradients"]["params"]) == GROUPS
    assert list(watch["gradients"]["modules"]) == ["(DeepSpeed fp32 copy)"]
    assert watch["steps"] == watch["sampled_steps"] == 4 and not watch["off"]
    # the norm of both groups' gradients is the one DeepSpeed computes itself
    assert watch["gradients"]["global_norm"] == pytest.approx(float(_losses(out)[-1].split()[-1]), rel=1e-5)


def test_zero2_on_two_ranks_merges_the_partitions_into_one_process_numbers(zero2, tmp_path):
    _, one = zero2
    env = _env()
    report = tmp_path / "report.json"
    code, out = run_job([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                         "--master-port", str(free_port()), "-m", "ampdoctor", "run", "--json", str(report),
                         str(SCRIPT), "--stage", "2"], tmp_path, env, timeout=300)
    assert code == 0, out[-4000:]
    two = json.loads(report.read_text())
    assert [(f["code"], f["ranks"]) for f in two["findings"]] == [("AMP212", [0, 1])]
    # each rank holds half of each group's flat gradient (the last one padded): merged, they are the whole one
    assert two["watch"]["gradients"]["merged_over_ranks"]["params"] == 2
    for name in GROUPS:
        merged, single = two["watch"]["gradients"]["params"][name], one["watch"]["gradients"]["params"][name]
        for stat in ("l2", "absmax", "min_nonzero", "zero_frac", "nonfinite"):
            assert merged[stat] == pytest.approx(single[stat], rel=1e-6), (name, stat)
    assert two["watch"]["gradients"]["global_norm"] == pytest.approx(one["watch"]["gradients"]["global_norm"],
                                                                       rel=1e-6)


def test_zero3_is_one_engine_and_the_watch_says_it_read_no_gradient(tmp_path):
    out, report = _single(tmp_path, "--stage", "3", ampdoctor=[])
    assert [(f["code"], f["where"]) for f in report["findings"]] == [("AMP212", "DeepSpeedEngine")]
    assert "6 model parameters" in report["findings"][0]["detail"]
    left = report["watch"]["gradients"]["unsummarised"]
    assert list(left) == ["AdamW"] and "ZeRO stage 3" in left["AdamW"]
    assert "left out of the gradient statistics (1): AdamW" in out


def test_fp32_deepspeed_is_no_mixed_precision(tmp_path):
    out, report = _single(tmp_path, "--stage", "0", "--dtype", "fp32", ampdoctor=[])
    assert report["findings"] == [] and report["ok"]
    assert "no mixed-precision problems found" in out


def test_accelerate_with_its_deepspeed_plugin_is_watched_through_its_wrappers(tmp_path):
    # DeepSpeedOptimizerWrapper (a torch Optimizer subclass without hook tables) -> DeepSpeedZeroOptimizer (none)
    # -> AdamW: the watch's hooks raised AttributeError on the wrapper (AMP001) before the chain went through
    out, report = _single(tmp_path, ampdoctor=[], script=ACCELERATE, ACCELERATE_USE_DEEPSPEED="true")
    assert [f["code"] for f in report["findings"]] == ["AMP212"], out[-3000:]
    assert "bf16 enabled; ZeRO stage 2" in report["findings"][0]["detail"]
    assert list(report["watch"]["gradients"]["params"]) == ["DeepSpeedZeroOptimizer.single_partition_of_fp32_groups[0]"]
    assert report["watch"]["sampled_steps"] == 6 and not report["watch"]["off"]
