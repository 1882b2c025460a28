"""Gradient statistics under real torch.distributed (gloo, 2 CPU processes; 4 for the 2-D dp x tp mesh): sharded
gradients (FSDP2, FSDP1 with and without ``use_orig_params``, FSDP2 + tensor parallelism) merged over ranks,
parameters that cannot be summarised named, and no hang when one rank's forward overflows under DDP.

Each case runs ``stats_scripts/sharded_watch.py`` in a subprocess (``torch.multiprocessing.spawn``, FileStore)
under a timeout: a hang fails the test instead of the suite.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from launch_jobs import run_job_streams

SCRIPT = Path(__file__).with_name("stats_scripts") / "sharded_watch.py"
TIMEOUT = 90  # seconds; a healthy run takes under 15 on 2 shared cores


def run(tmp_path: Path, mode: str, world: int) -> list[dict]:
    out = tmp_path / f"{mode}-{world}"
    command = [sys.executable, str(SCRIPT), mode, str(world), str(out)]
    returncode, _, stderr = run_job_streams(command, tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"}, TIMEOUT)
    assert returncode == 0, stderr[-3000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(world)]


def assert_same_stats(got: dict, want: dict, rel: float = 1e-6, tol: float = 0.0) -> None:
    assert set(got) == set(want) and got
    for name, stats in want.items():
        assert set(got[name]) == set(stats), name
        for key, value in stats.items():
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(got[name][key]), (name, key)
            else:  # L2 sums float32 squares shard by shard: the order differs, so allow rounding
                assert got[name][key] == pytest.approx(value, rel=rel, abs=tol), (name, key, got[name][key], value)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    return run(tmp, "fsdp2", 2), run(tmp, "fsdp2", 1)


def test_fsdp2_bf16_statistics_merged_over_two_ranks_equal_one_process(fsdp2) -> None:
    two, (one,) = fsdp2
    for rank in two:
        # the same batch on every rank: the averaged gradient is the one-process gradient
        assert_same_stats(rank["stats"], one["stats"])
        assert rank["stats"]["4.bias"]["sampled"] == 3  # 2 + 1 entries on the two ranks: the whole tensor
        # and against the full gradients gathered (full_tensor) in the same run
        assert_same_stats(rank["stats"], rank["reference"])
    assert two[0]["stats"] == two[1]["stats"]  # every rank reports the same merged numbers
    for rank in (*two, one):   # the DTensor norm clip_grad_norm_ returned did not break the watch (it did: AMP001)
        assert rank["clip_norm"][0] == "DTensor" and rank["findings"] == [], (rank["clip_norm"], rank["findings"])
        # a replicated DTensor: the norm before clipping, read locally, the same as one process's
        assert rank["clip_norm"][1] == ["R"]
        assert rank["gradients"]["pre_clip_norm"] == pytest.approx(one["gradients"]["pre_clip_norm"], rel=1e-6)
    merged = two[0]["gradients"]["merged_over_ranks"]
    assert merged == {"params": 6, "collectives": 4}  # 2 sampled steps x (one MAX + one SUM): not one per tensor
    # one copy per sampled step (with the values of the activation monitor armed for the dense start)
    assert two[0]["host_syncs"] == 2
    assert "merged_over_ranks" not in one["gradients"]  # one rank: nothing to merge, no collective


def test_fsdp1_flat_parameter_is_merged_without_its_padding(tmp_path) -> None:
    ranks = run(tmp_path, "fsdp1", 2)
    assert {r["pad"] for r in ranks} == {0, 1}  # 875 entries over 2 ranks: one zero of padding on rank 1
    for rank in ranks:
        assert_same_stats(rank["stats"], rank["reference"])
        assert rank["stats"]["_flat_param"]["sampled"] == 875  # named as the model spells it: no FSDP attribute


def test_a_partial_gradient_is_named_in_the_summary_not_left_out_silently(tmp_path) -> None:
    for rank in run(tmp_path, "partial", 2):
        assert "4.weight" not in rank["stats"] and "4.bias" in rank["stats"]
        assert "partial DTensor" in rank["gradients"]["unsummarised"]["4.weight"]


def test_one_rank_overflowing_under_ddp_names_the_module_without_a_hang(tmp_path) -> None:
    ranks = run(tmp_path, "ddp_overflow", 2)
    for rank in ranks:
        # DDP's all-reduce sums rank 1's inf into every rank's gradients: both scalers find it and both skip
        assert [s["found_inf"] for s in rank["steps"]] == [0.0, 1.0]
        assert [s["params_unchanged"] for s in rank["steps"]] == [False, True]
    first = ranks[1]["activations"]["first_nonfinite_forward"]
    assert (first["module"], first["rank"], first["frames"]) == ("module.0", 1, None)  # named, not re-run
    amp601 = [f for f in ranks[1]["findings"] if f["code"] == "AMP601"]
    assert amp601 and "on rank 1" in amp601[0]["detail"] and "Not re-run" in amp601[0]["detail"]
    assert ranks[0]["activations"]["first_nonfinite_forward"] is None  # rank 0's own forward stayed finite


def test_a_collective_inside_the_forward_stops_the_one_rank_replay_before_it_starts(tmp_path) -> None:
    # No wrapper, so nothing tells that the forward communicates: a module all-reduces in it (as SyncBatchNorm
    # does). Rank 1 alone overflows, and its activation monitor re-runs the forward to dump frames: the re-run's
    # all-reduce would wait for rank 0, or pair with rank 0's next forward. It is stopped before it starts.
    # The module's all-reduce carries rank 1's inf into rank 0's forward too, so rank 0 replays as well: each rank
    # names its own first non-finite module, and each re-run stops at the collective.
    ranks = run(tmp_path, "collective_forward", 2)
    for rank, module in ((1, "0 (Linear)"), (0, "1 (CrossRankCenter)")):
        amp601 = next(f for f in ranks[rank]["findings"] if f["code"] == "AMP601")
        assert (amp601["where"], amp601["step"]) == (module, 1) and f"on rank {rank}" in amp601["detail"], amp601
        assert f"c10d.allreduce_.default) on rank {rank} of 2; the re-run stopped before it" in amp601["detail"]
        assert len(ranks[rank]["losses"]) == 3   # both ranks trained to the end: nobody waited


@pytest.mark.parametrize("kind", ["plain", "sharded", "none"])
def test_amp608_is_raised_by_the_rank_whose_own_shard_stepped_on_the_inf(tmp_path, kind) -> None:
    # The statistics are merged over the ranks, so both see the inf rank 0's shard holds; each rank steps its own.
    ranks = run(tmp_path, f"inf_{kind}", 2)
    amp608 = [[f["step"] for f in rank["findings"] if f["code"] == "AMP608"] for rank in ranks]
    if kind == "plain":   # each plain GradScaler checks its own shard: rank 0 skips, rank 1 steps on finite ones
        assert [r["stepped"] for r in ranks] == [[True, False], [True, True]]
        assert [r["scales"][-1] for r in ranks] == [32768.0, 65536.0]   # AMP411's, when the job's reports merge
        assert amp608 == [[], []]   # it said "no GradScaler skipped it" on rank 1, whose step took finite gradients
    elif kind == "sharded":   # found_inf all-reduced: both skip
        assert [r["stepped"] for r in ranks] == [[True, False], [True, False]]
        assert amp608 == [[], []]
    else:   # no scaler: rank 0 stepped on its inf, rank 1 on its finite shard
        assert [r["stepped"] for r in ranks] == [[True, True], [True, True]]
        assert amp608 == [[1], []]
        detail = next(f["detail"] for f in ranks[0]["findings"] if f["code"] == "AMP608")
        assert "no GradScaler skipped it" in detail


def test_fsdp1_use_orig_params_statistics_per_original_parameter_equal_one_process(tmp_path) -> None:
    ranks = run(tmp_path, "fsdp1_orig", 2)
    # 875 entries split 438 / 437: 2.weight is split across the ranks, five parameters have no entry on one rank
    assert ranks[0]["local_numels"]["_fsdp_wrapped_module.2.weight"] == 126
    assert ranks[1]["local_numels"]["_fsdp_wrapped_module.2.weight"] == 354
    assert {n for r in ranks for n, k in r["local_numels"].items() if k == 0} == {
        f"_fsdp_wrapped_module.{n}" for n in ("0.weight", "0.bias", "2.bias", "4.weight", "4.bias")}
    for rank in ranks:
        # the same batch on every rank: the averaged gradient is the single-process one, exactly
        # named as the plain model names them (named_parameters() says _fsdp_wrapped_module.0.weight)
        assert_same_stats(rank["stats"], rank["single"])  # a plain model trained alone, same batches
        assert_same_stats(rank["stats"], rank["reference"])  # FSDP's own gathered gradients (summon_full_params)
        assert rank["stats"]["2.weight"]["sampled"] == 480  # 126 + 354: the whole tensor
        assert rank["stats"]["0.weight"]["sampled"] == 288  # all on rank 0, none on rank 1
        assert "unsummarised" not in rank["gradients"]
        assert rank["gradients"]["merged_over_ranks"] == {"params": 6, "collectives": 4}  # 2 steps x (MAX + SUM)
    assert ranks[0]["stats"] == ranks[1]["stats"]


def test_fsdp2_over_dp_with_tensor_parallel_over_tp_merges_over_both_mesh_dims(tmp_path) -> None:
    ranks = run(tmp_path, "dp_tp", 4)
    placements = ranks[0]["placements"]
    # fully_shard over dp on a column-parallel weight: a _StridedShard, which torch 2.13 does not call a Shard
    assert placements["0.weight"] == ["_S(0, 2)", "S(0)"] and placements["2.weight"] == ["S(0)", "S(1)"]
    assert placements["2.bias"] == ["S(0)", "R"] and placements["5.weight"] == ["S(0)"]
    assert [r["local_numels"]["4.weight"] for r in ranks] == [20, 20, 0, 0]  # empty on the dp=1 ranks
    for rank in ranks:
        assert_same_stats(rank["stats"], rank["reference"])  # the full gradients (full_tensor) of the same run
        # a plain model alone on the same batch: the row-parallel all-reduce sums in another order, so the
        # gradients differ in the last bits (1e-8 is 1e-6 of the largest entries); the counts are the same
        assert_same_stats(rank["stats"], rank["single"], rel=1e-5, tol=1e-8)
        assert {n: s["sampled"] for n, s in rank["stats"].items()} == {
            "0.weight": 288, "0.bias": 24, "2.weight": 480, "2.bias": 20, "4.weight": 40, "4.bias": 2,
            "5.weight": 6, "5.bias": 3}  # every entry once: none counted twice (tp replicas), none missed
        assert "unsummarised" not in rank["gradients"]
        # 2 sampled steps x (MAX + SUM) x 2 groups (this rank's dp and tp groups): per mesh dim, not per tensor
        assert rank["gradients"]["merged_over_ranks"] == {"params": 8, "collectives": 8}
    assert all(r["stats"] == ranks[0]["stats"] for r in ranks)


def test_placements_that_split_a_tensor_are_merged_and_unknown_ones_are_not() -> None:
    from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

    from ampdoctor._torch.distributed import placement_kind

    class Diagonal(Placement):  # a placement torch could add: which entries a rank holds is not known here
        pass

    kinds = [placement_kind(p) for p in (Shard(1), _StridedShard(0, split_factor=2), Replicate(), Partial(),
                                         Diagonal())]
    assert kinds == ["shard", "shard", "replicate", "partial", "unknown"]
