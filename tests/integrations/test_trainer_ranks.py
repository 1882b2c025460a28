"""The transformers callback in a job of two processes: a real ``Trainer.train()`` under torchrun, gloo (CPU).

Each test runs ``python -m torch.distributed.run --nproc-per-node 2 rank_scripts/trainer_ddp.py`` in a subprocess
with a timeout (see conftest.py): ``use_cpu=True, bf16=True``, a tiny BERT from a config. Rank 0 prints the job's
report once and writes one JSON whose findings list the ranks that saw them; each rank keeps its own flight
recorder; a crash on rank 1 alone is reported with its rank.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from ampdoctor.monitor.recorder import read_log  # noqa: E402

SCRIPT = Path(__file__).parent / "rank_scripts" / "trainer_ddp.py"


def _torchrun(port: int, mode: str, folder: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
            str(SCRIPT), mode, str(folder)]


def test_the_stray_half_classifier_on_every_rank_is_one_finding_listing_both_ranks(tmp_path, rank_job, job_port):
    code, output = rank_job(_torchrun(job_port, "seed", tmp_path), tmp_path)
    assert code == 0, output[-5000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert sorted((f["code"], f["where"], f.get("ranks")) for f in report["findings"]) == [
        ("AMP103", "optimizer[0] group 0", [0, 1]), ("AMP103", "optimizer[0] group 1", [0, 1]),
        ("AMP209", "TrainingArguments(bf16=True)", [0, 1])], output[-5000:]
    assert report["ranks"]["reported"] == [0, 1] and report["ranks"]["missing"] == []
    assert report["observed"] == {"models": 2, "optimizers": 2, "scalers": 0}
    # Printed by rank 0 alone: the pre-flight report before the first step, then the job's report at the end.
    assert output.count("ampdoctor findings") == 2, output[-5000:]
    assert output.count("ampdoctor watch:") == 1
    assert output.count("    on ranks 0, 1\n") == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json") == ["report.json"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["ampdoctor.rank0.jsonl", "ampdoctor.rank1.jsonl"]
    for rank in (0, 1):
        header, records, problems = read_log(tmp_path / "logs" / f"ampdoctor.rank{rank}.jsonl")
        assert problems == [] and (header["rank"], header["world_size"]) == (rank, 2)
        assert [r["step"] for r in records if r["type"] == "step" and not r.get("partial")] == [0, 1, 2, 3]
        own = records[-1]   # each rank's log ends with its own report
        assert own["type"] == "report" and sorted(f["code"] for f in own["report"]["findings"]) == [
            "AMP103", "AMP103", "AMP209"]
    assert not list(Path(tempfile.gettempdir()).glob(f"ampdoctor-*-ranks-127.0.0.1-{job_port}-*"))


def test_a_crash_on_rank_1_alone_is_reported_with_its_rank(tmp_path, rank_job, job_port):
    # Rank 0 blocks in DDP's all-reduce on rank 1, which reports its own crash, labelled; rank 0, failing once
    # rank 1 is gone, merges both ranks' reports and does not repeat the crash.
    code, output = rank_job(_torchrun(job_port, "crash1", tmp_path), tmp_path)
    assert code != 0, output[-5000:]
    assert output.count("on rank 1: RuntimeError: rank 1 broke at step 2") == 1, output[-5000:]
    assert "ampdoctor: rank 1 failed with RuntimeError, which is not a known mixed-precision failure" in output
    report = json.loads((tmp_path / "report.json").read_text())   # rank 0's merge, or rank 1's own if rank 0 died
    assert (report["exception"]["type"], report["exception"]["rank"]) == ("RuntimeError", "1")
    assert report["exception"]["message"] == "rank 1 broke at step 2"
    header, records, _ = read_log(tmp_path / "logs" / "ampdoctor.rank1.jsonl")
    assert header["rank"] == 1 and records[-1]["type"] == "report"
    assert records[-1]["report"]["exception"]["type"] == "RuntimeError"
    assert read_log(tmp_path / "logs" / "ampdoctor.rank0.jsonl")[0]["rank"] == 0
