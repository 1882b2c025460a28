"""What a newcomer compared across the views of one run, and found different: each number is written once and every
view says it the same way (the step counts, the loss scale after the last step, the parameters whose updates were
lost, the bound below which an update is lost)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import textwrap
from pathlib import Path

from ampdoctor.ui.cli import main

COLLAPSE = Path(__file__).parents[1] / "scripts" / "sqrt_of_zero.py"   # 60 steps, every one skipped

# pure bf16 with a learning rate too small for bf16 weights: most updates of every tensor round away, the
# 1-entry bias of the last layer's too
LOST = textwrap.dedent("""\
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 1)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(64, 16, dtype=torch.bfloat16)
    y = x[:, :1] * 2
    for step in range(20):
        loss = nn.functional.mse_loss(model(x).float(), y.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
""")


def _run(*argv: str) -> tuple[int, str]:
    """`ampdoctor run ARGV`, in this process: its exit status and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["run", *argv])
    return code, out.getvalue()


def _report(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["report", *argv])
    return code, out.getvalue()


def _joined(text: str) -> str:
    return " ".join(text.split())


def test_the_run_and_its_log_say_the_same_step_counts_and_last_loss_scale(tmp_path):
    code, run = _run("--log-dir", str(tmp_path / "logs"), str(COLLAPSE))
    assert code == 0, run
    said = _joined(run)
    assert "ampdoctor watch: 60 steps, 11 sampled (every 50)" in said
    code, report = _report(str(tmp_path / "logs"))
    assert code == 0, report
    assert f"flight recorder {tmp_path / 'logs'}: 60 steps, 11 sampled," in _joined(report)
    # the finding, the watch's line and the log's table: one scale after the last step, written one way
    after = re.search(r"to (\S+) after step 59", said).group(1)
    assert after == "5.68e-14"
    assert f"loss scale {after} (peak 65536 at step 0, lowest {after})" in said
    assert f"loss scale after step 59: {after}" in report
    assert "last completed sampled step: 50" in report   # the line written at the end is no sampled step
    assert not [line for line in report.splitlines() if line != line.rstrip()]   # no trailing blanks


def test_every_parameter_of_the_lost_updates_table_is_named_by_a_finding(tmp_path):
    script, out = tmp_path / "train.py", tmp_path / "r.json"
    script.write_text(LOST)
    code, run = _run("--json", str(out), str(script))
    assert code == 0, run
    table = run[run.index("updates lost to rounding"):run.index("ampdoctor findings")]
    rows = re.findall(r"^(\S+)\s+bfloat16\s+(\d+)%$", table, re.M)
    lost = [name for name, percent in rows if int(percent) > 50]
    assert "4.bias" in lost, table
    findings = run[run.index("ampdoctor findings"):run.index("how to fix")]
    named = set(re.findall(r"AMP607 warning \(step \d+\) (\S+):", findings))
    rest = re.search(r"AMP607 warning and \d+ more AMP607 findings? like the above, at (.+?) \(all", _joined(findings))
    named |= set(rest.group(1).split(", ")) if rest else set()
    assert set(lost) <= named, (lost, named)
    assert set(lost) <= {f["where"] for f in json.loads(out.read_text())["findings"] if f["code"] == "AMP607"}


def test_amp103_and_amp607_state_one_bound_for_a_lost_update(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LOST)
    code, run = _run(str(script))
    said = _joined(run)
    bounds = set(re.findall(r"\|w\|·2\*\*-(\d+)", said))
    assert bounds == {"9", "12"}, bounds   # bf16's and fp16's, never 2**-8 beside 2**-9
    assert "An update smaller than |w|·2**-9 rounds away" in said   # AMP103's finding, for this bf16 model
