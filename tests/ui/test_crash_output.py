"""What `ampdoctor run` prints after a crash: the script's traceback, then right under it the findings that explain
it, naming the parameters of each module (not a Sequential's bare index), then the watch's numbers."""

from __future__ import annotations

import textwrap

from ampdoctor.ui.cli import main
from ampdoctor.ui.demo import DEMO_SCRIPT

# trains 15 steps (the watch has a gradient table by then), then one submodule is cast and unscale_ raises
LATE_HALF = textwrap.dedent("""\
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(16, 8)
    for step in range(20):
        if step == 15:
            model[3].half()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
""")


def test_after_a_crash_the_findings_come_right_under_the_traceback(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(LATE_HALF)
    assert main(["run", str(script)]) == 1
    err = capsys.readouterr().err
    lines = err.splitlines()
    error = lines.index("ValueError: Attempting to unscale FP16 gradients.")
    assert lines[error + 1] == "ampdoctor findings"
    assert lines[error + 2].startswith("AMP101 error (step 15) module 3: ")
    assert err.index("how to fix") < err.index("ampdoctor watch: 15 steps") < err.index("gradients at step")


def test_the_modules_of_a_finding_are_named_by_their_parameters(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(DEMO_SCRIPT)   # nn.Sequential(Linear, GELU, Linear).half()
    assert main(["run", "--no-watch", str(script)]) == 1
    lines = capsys.readouterr().err.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("AMP101 error 2 modules:"))
    assert lines[head + 1:head + 3] == ["    0.weight (float16, [64, 32]), 0.bias (float16, [64])",
                                        "    2.weight (float16, [1, 64]), 2.bias (float16, [1])"]
    assert not [line for line in lines if line.strip() in ("0", "2")]   # no bare Sequential index on a line
