"""The transformers callback in a job of two processes: a real ``Trainer.train()`` under torchrun, gloo (CPU).

Each test runs ``python -m torch.distributed.run --nproc-per-node 2 rank_scripts/trainer_ddp.py`` in a subprocess
with a timeout (see conftest.py): ``use_cpu=True, bf16=True``, a tiny BERT from a config. Rank 0 prints the job's
report once and writes one JSON whose findings list the ranks that saw them; each rank keeps its own flight
recorder; a crash on rank 1 alone is reported with its rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from rank_checks import check_crash_on_rank_1, check_job_report

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = Path(__file__).parent / "rank_scripts" / "trainer_ddp.py"


def _torchrun(port: int, mode: str, folder: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
            str(SCRIPT), mode, str(folder)]


def test_the_stray_half_classifier_on_every_rank_is_one_finding_listing_both_ranks(tmp_path, rank_job, job_port):
    code, output = rank_job(_torchrun(job_port, "seed", tmp_path), tmp_path)
    assert code == 0, output[-5000:]
    report, own_codes = check_job_report(tmp_path, output, job_port, rank_lines=3)
    assert sorted((f["code"], f["where"], f.get("ranks")) for f in report["findings"]) == [
        ("AMP103", "optimizer[0] group 0", [0, 1]), ("AMP103", "optimizer[0] group 1", [0, 1]),
        ("AMP209", "TrainingArguments(bf16=True)", [0, 1])], output[-5000:]
    assert own_codes == [["AMP103", "AMP103", "AMP209"]] * 2


def test_a_crash_on_rank_1_alone_is_reported_with_its_rank(tmp_path, rank_job, job_port):
    # Rank 0 blocks in DDP's all-reduce on rank 1, which reports its own crash, labelled; rank 0, failing once
    # rank 1 is gone, merges both ranks' reports and does not repeat the crash.
    code, output = rank_job(_torchrun(job_port, "crash1", tmp_path), tmp_path)
    check_crash_on_rank_1(tmp_path, code, output)
