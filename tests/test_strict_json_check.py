"""The strict-JSON check run after each test (tests/strict_json_check.py): it names ampdoctor's files with a NaN or
Infinity token, and leaves other files alone."""

from __future__ import annotations

import json
import math

import pytest
from strict_json_check import nonstrict_files


@pytest.mark.nonstrict_json   # it writes the old tokens on purpose: they are what the check must find
def test_the_check_names_the_file_line_and_token_of_ampdoctors_json_only(tmp_path):
    old_report = {"schema": "ampdoctor.core.report/1", "watch": {"gradients": {"global_norm": math.nan}}}
    (tmp_path / "report.json").write_text(json.dumps(old_report, indent=2))   # as ampdoctor wrote it before
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "ampdoctor.jsonl").write_text(
        json.dumps({"type": "header"}) + "\n" + json.dumps({"type": "step", "loss": {"value": -math.inf}}) + "\n")
    (tmp_path / "rank1").mkdir()
    (tmp_path / "rank1" / "rank1.json").write_text(json.dumps({"rank": 1, "report": {"peak": math.inf}}))
    (tmp_path / "strict.json").write_text(json.dumps({**old_report, "watch": "nan"}))   # the strings: strict
    (tmp_path / "config.json").write_text(json.dumps({"layer_norm_eps": math.nan}))     # another library's
    (tmp_path / "garbage.json").write_text("NaN, no JSON {")
    (tmp_path / "torn.jsonl").write_text('{"type": "step", "loss": NaN, "gradients": ')   # cut mid-line
    assert sorted(nonstrict_files(tmp_path)) == [
        f"{tmp_path}/logs/ampdoctor.jsonl line 2: -Infinity at loss.value",
        f"{tmp_path}/rank1/rank1.json: Infinity at report.peak",
        f"{tmp_path}/report.json: NaN at watch.gradients.global_norm",
    ]
