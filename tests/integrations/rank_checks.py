"""What every rank test of a framework callback checks, whatever the framework: one report for the job, printed
once, with the ranks of each finding, one flight recorder per rank; a crash on rank 1 alone reported with its rank.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ampdoctor.core.records import read_log


def check_job_report(folder: Path, output: str, port: int, *, rank_lines: int) -> tuple[dict, list[list[str]]]:
    """Check the job's one JSON, what rank 0 printed and the two logs; return the report and each rank's codes.

    ``rank_lines``: how many findings rows say "on ranks 0, 1" (one per finding seen on both ranks).
    """
    report = json.loads((folder / "report.json").read_text())
    assert report["ranks"]["reported"] == [0, 1] and report["ranks"]["missing"] == []
    assert report["observed"] == {"models": 2, "optimizers": 2, "scalers": 0}
    # Printed by rank 0 alone, once: the job's report at the end (each finding once, with its ranks).
    assert output.count("ampdoctor findings") == 1, output[-5000:]
    assert output.count("ampdoctor watch:") == 1
    assert output.count("    on ranks 0, 1\n") == rank_lines
    assert sorted(p.name for p in folder.iterdir() if p.suffix == ".json") == ["report.json"]
    assert sorted(p.name for p in (folder / "logs").iterdir()) == ["ampdoctor.rank0.jsonl", "ampdoctor.rank1.jsonl"]
    own_codes = []
    for rank in (0, 1):
        header, records, problems = read_log(folder / "logs" / f"ampdoctor.rank{rank}.jsonl")
        assert problems == [] and (header["rank"], header["world_size"]) == (rank, 2)
        assert [r["step"] for r in records if r["type"] == "step"] == [0, 1, 2, 3]
        own = records[-1]   # each rank's log ends with its own report
        assert own["type"] == "report"
        own_codes.append(sorted(f["code"] for f in own["report"]["findings"]))
    # the exchange folder (in the temporary directory) is gone
    assert not list(Path(tempfile.gettempdir()).glob(f"ampdoctor-*-ranks-127.0.0.1-{port}-*"))
    return report, own_codes


def check_crash_on_rank_1(folder: Path, code: int, output: str) -> None:
    """A RuntimeError raised on rank 1 at step 2: printed once, labelled with its rank; rank 1's log ends with it."""
    assert code != 0, output[-5000:]
    assert output.count("on rank 1: RuntimeError: rank 1 broke at step 2") == 1, output[-5000:]
    flowing = " ".join(output.split())   # the console wraps at 80 columns
    assert "ampdoctor: rank 1 failed with RuntimeError, which is not a known mixed-precision failure" in flowing
    report = json.loads((folder / "report.json").read_text())   # rank 0's merge, or rank 1's own if rank 0 died
    assert (report["exception"]["type"], report["exception"]["rank"]) == ("RuntimeError", "1")
    assert report["exception"]["message"] == "rank 1 broke at step 2"
    header, records, _ = read_log(folder / "logs" / "ampdoctor.rank1.jsonl")
    assert header["rank"] == 1 and records[-1]["type"] == "report"
    assert records[-1]["report"]["exception"]["type"] == "RuntimeError"
    assert read_log(folder / "logs" / "ampdoctor.rank0.jsonl")[0]["rank"] == 0
