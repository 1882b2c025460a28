"""`ampdoctor run` on a script that stops before its end: Ctrl-C, a script that does not compile. What the user sees
is the script's own traceback as `python script.py` prints it, then one line of ampdoctor's that says why this is
no all-clear, with no advice that does not fit (an interrupt is not a crash to look into)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from ampdoctor.ui.cli import main

TRAINS_FOREVER = textwrap.dedent("""\
    import sys
    import torch
    from torch import nn

    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10**9):
        loss = model(torch.randn(2, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 20:
            print("ready", flush=True)
""")


def _own_frames(text):
    return [line for line in text.splitlines() if "runpy" in line or "ampdoctor" + os.sep in line
            or "launcher.py" in line]


def test_ctrl_c_shows_the_scripts_frames_only_and_says_the_run_was_stopped(tmp_path):
    script, report = tmp_path / "train.py", tmp_path / "r.json"
    script.write_text(TRAINS_FOREVER)
    proc = subprocess.Popen([sys.executable, "-m", "ampdoctor", "run", "--json", str(report), str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)   # what Ctrl-C sends
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.startswith("Traceback (most recent call last):\n"), err
    assert "KeyboardInterrupt" in err
    assert not _own_frames(err.split("KeyboardInterrupt")[0]), err   # no runpy, no ampdoctor frame
    assert "stopped by Ctrl-C after" in " ".join(err.split())
    assert "--activations" not in err and "not a known mixed-precision failure" not in err
    data = json.loads(report.read_text())
    assert data["exception"]["type"] == "KeyboardInterrupt"
    assert data["exit_status"] == 130 and data["terminated"] == "Ctrl-C"


def test_a_keyboard_interrupt_in_the_script_is_a_stop_not_a_crash(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(TRAINS_FOREVER.replace('print("ready", flush=True)', "raise KeyboardInterrupt"))
    assert main(["run", str(script)]) == 130
    err = capsys.readouterr().err
    assert not _own_frames(err), err
    assert f'File "{script}", line 13, in <module>' in err
    said = " ".join(err.split())
    assert "the run was stopped by Ctrl-C after 21 optimizer steps (exit status 130)" in said
    assert "--activations" not in said


def test_a_syntax_error_is_shown_once_as_python_shows_it(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("import torch\nx = (1,\nprint('hi')\n")
    assert main(["run", str(script)]) == 1
    err = capsys.readouterr().err
    python = subprocess.run([sys.executable, str(script)], capture_output=True, text=True).stderr
    assert err.startswith(python), (err, python)   # the same lines as `python train.py`, no runpy frame
    assert err.count("SyntaxError") == 2, err   # python's line, and ampdoctor's one line naming it
    rest = err[len(python):]
    assert " ".join(rest.split()) == ("ampdoctor: the script did not start (SyntaxError, above): nothing ran, so "
                                      "nothing was diagnosed")
