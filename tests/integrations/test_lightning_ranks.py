"""The Lightning callback in a job of two processes: real ``strategy="ddp_spawn"``/``"ddp"`` on gloo (CPU).

Each test runs ``rank_scripts/lightning_ddp.py`` in a subprocess with a timeout (see conftest.py). Every rank
diagnoses its replica; rank 0 prints the job's report once and writes one JSON whose findings list the ranks that
saw them; each rank keeps its own flight recorder; a crash on rank 1 alone is reported with its rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from rank_checks import check_crash_on_rank_1, check_job_report

pytest.importorskip("lightning")

SCRIPT = Path(__file__).parent / "rank_scripts" / "lightning_ddp.py"


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp"])
def test_the_stray_half_head_on_every_rank_is_one_finding_listing_both_ranks(tmp_path, strategy, rank_job, job_port):
    code, output = rank_job([sys.executable, str(SCRIPT), strategy, "seed", str(tmp_path)], tmp_path,
                            MASTER_PORT=str(job_port))
    assert code == 0, output[-5000:]
    report, own_codes = check_job_report(tmp_path, output, job_port, rank_lines=1)
    assert [(f["code"], f.get("ranks")) for f in report["findings"]] == [("AMP103", [0, 1])], output[-5000:]
    assert own_codes == [["AMP103"], ["AMP103"]]
    # no folder configured (AMPDOCTOR_RANK_DIR unset) and no torchrun store: a private folder of this user's
    assert report["ranks"]["via"].startswith("the folder ") and "ampdoctor-" in report["ranks"]["via"]


def test_a_crash_on_rank_1_alone_is_reported_with_its_rank(tmp_path, rank_job, job_port):
    # Under ddp_spawn Lightning calls no on_exception in the workers; rank 0 blocks in DDP's all-reduce meanwhile,
    # so rank 1 reports its own crash, labelled, and rank 0 (if the launcher lets it) does not repeat it.
    code, output = rank_job([sys.executable, str(SCRIPT), "ddp_spawn", "crash1", str(tmp_path)], tmp_path,
                            MASTER_PORT=str(job_port))
    check_crash_on_rank_1(tmp_path, code, output)
