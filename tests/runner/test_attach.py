"""``ampdoctor.attach()`` and ``AMPDOCTOR=1``: a script run with plain ``python`` gets ``ampdoctor run``'s diagnosis.

Each script runs in a real ``python`` process (atexit, sys.excepthook and the start-up hook only exist there); its
findings are compared with those ``ampdoctor run --json`` gives on the same script.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ampdoctor.core.usage import UsageError
from ampdoctor.runner.attached import attach

SRC = str(Path(__file__).resolve().parents[2] / "src")
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
PTH = "ampdoctor-env.pth"


def python(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python *argv`` with this checkout's ampdoctor first on the path (as the editable install has it)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AMPDOCTOR")}
    environ["PYTHONPATH"] = SRC + (os.pathsep + environ["PYTHONPATH"] if environ.get("PYTHONPATH") else "")
    environ.update(env or {})
    return subprocess.run([sys.executable, *argv], env=environ, cwd=cwd, capture_output=True, text=True,
                          timeout=240)


def with_attach(tmp_path: Path, name: str, call: str) -> Path:
    """``tests/scripts/<name>`` with ``import ampdoctor; <call>`` as its first line (what a user adds)."""
    path = tmp_path / name
    path.write_text(f"import ampdoctor; {call}\n" + (SCRIPTS / name).read_text())
    return path


def findings(path: Path) -> list[tuple[str, str, str]]:
    return [(f["code"], f["severity"], f["where"]) for f in json.loads(path.read_text())["findings"]]


def run_json(tmp_path: Path, name: str, *args: str) -> tuple[int, list[tuple[str, str, str]]]:
    out = tmp_path / "run.json"
    proc = python("-m", "ampdoctor.ui.cli", "run", "--json", str(out), str(SCRIPTS / name), *args)
    return proc.returncode, findings(out)


def env_switch_installed() -> bool:
    return any((Path(p) / PTH).is_file() for p in site.getsitepackages() + [site.getusersitepackages()])


@pytest.mark.parametrize("name,args", [("seed.py", ["5"]), ("hand_loss_scaler.py", ["broken"])])
def test_attach_in_a_plain_python_script_gives_run_s_findings_report_at_exit_status_unchanged(tmp_path, name, args):
    status, expected = run_json(tmp_path, name, *args)
    out = tmp_path / "attach.json"
    proc = python(str(with_attach(tmp_path, name, f"ampdoctor.attach(json_path={str(out)!r})")), *args)
    assert proc.returncode == status   # the script's own status: 1 for seed.py's crash, 0 for the other
    assert findings(out) == expected and expected
    err = proc.stderr
    assert f"{expected[0][0]} {expected[0][1]}" in err   # the report, on stderr, at exit
    if name == "seed.py":   # the traceback as python prints it, then the explanation under it
        assert err.index("ValueError: Attempting to unscale FP16 gradients.") < err.index("AMP101")
        assert "ampdoctor/core/patch.py" not in err and "upcast_trainable_params_" in err
    assert f"report written to {out}" in err


def test_the_environment_switch_gives_the_same_findings_without_editing_the_script(tmp_path):
    if not env_switch_installed():
        pytest.fail(f"{PTH} is not in site-packages: install ampdoctor with pip (pip install -e .), which puts it "
                    "there (setup.py)")
    status, expected = run_json(tmp_path, "seed.py", "5")
    out = tmp_path / "env.json"
    proc = python(str(SCRIPTS / "seed.py"), "5", env={"AMPDOCTOR": f"--json {out}"})
    assert (proc.returncode, findings(out)) == (status, expected)
    assert "AMP101 error" in proc.stderr
    quiet = python("-c", "import torch; print('no training')", env={"AMPDOCTOR": "1"})
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "no training\n", "")   # trains nothing: silent


def test_the_environment_switch_under_torchrun_gives_one_report_the_agent_stays_silent(tmp_path):
    """``AMPDOCTOR=... torchrun ...``: torchrun's agent imports torch too, trains nothing and fails with
    ChildFailedError after its workers; it says nothing and does not overwrite rank 0's JSON."""
    from launch_jobs import clean_environment, free_port, run_job

    if not env_switch_installed():
        pytest.fail(f"{PTH} is not in site-packages: pip install -e .")
    script = str(SCRIPTS / "torchrun_seed.py")
    env = clean_environment(OMP_NUM_THREADS="1", PYTHONPATH=SRC)

    def torchrun(*argv: str, **extra: str) -> tuple[int, str]:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                  "--master-port", str(free_port()), *argv]
        return run_job(launch, tmp_path, {**env, **extra}, timeout=180)

    status, _ = torchrun("-m", "ampdoctor", "run", "--json", "run.json", script)
    code, output = torchrun(script, AMPDOCTOR="--json env.json")
    assert (code, findings(tmp_path / "env.json")) == (status, findings(tmp_path / "run.json"))
    assert status == 1 and output.count("ampdoctor findings") == 1 and "on ranks 0, 1" in output
    assert "nothing was trained" not in output and "which is not a known mixed-precision failure" not in output


def test_the_environment_switch_with_fix_repairs_the_run_in_80_columns(tmp_path):
    if not env_switch_installed():
        pytest.fail(f"{PTH} is not in site-packages: pip install -e .")
    proc = python(str(SCRIPTS / "seed.py"), "3", env={"AMPDOCTOR": "--fix", "COLUMNS": "80"})
    assert proc.returncode == 0 and proc.stdout.count("loss ") == 3   # the seed error is gone: it trains
    assert proc.stderr.startswith("ampdoctor --fix: upcast trainable parameters to float32")
    assert "ampdoctor --fix resolved AMP101 (2 places), AMP104 (1 place)" in proc.stderr
    assert [line for line in proc.stderr.splitlines() if len(line) > 80] == []   # its own lines wrapped too


def test_a_script_s_own_attach_joins_the_environment_s_run(tmp_path):
    if not env_switch_installed():
        pytest.fail(f"{PTH} is not in site-packages: pip install -e .")
    script = with_attach(tmp_path, "seed.py", f"ampdoctor.attach(json_path={str(tmp_path / 'own.json')!r})")
    proc = python(str(script), "3", env={"AMPDOCTOR": "--fix", "COLUMNS": "80"})
    assert proc.returncode == 0 and proc.stdout.count("loss ") == 3   # other options: no UsageError, it trains
    assert "the script's attach() joins the run AMPDOCTOR='--fix' started" in proc.stderr
    assert proc.stderr.count("ampdoctor --fix resolved AMP101") == 1


def test_a_bad_environment_switch_stops_before_the_script_with_the_reason(tmp_path):
    if not env_switch_installed():
        pytest.fail(f"{PTH} is not in site-packages: pip install -e .")
    proc = python("-c", "print('script ran')", env={"AMPDOCTOR": "--fx"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert "AMPDOCTOR='--fx': '--fx' is not one of run's options; use AMPDOCTOR=1" in proc.stderr
    proc = python("-c", "print('script ran')", env={"AMPDOCTOR": f"--json {tmp_path}"})
    assert proc.returncode == 2 and f"--json '{tmp_path}' is a folder" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_exit_status_and_verdict_follow_sys_exit(tmp_path):
    for status in (0, 3):
        proc = python(str(with_attach(tmp_path, "exit_status.py", "ampdoctor.attach()")), str(status), "4")
        assert proc.returncode == status
        if status:
            assert "the script exited with status 3 after 4 optimizer steps" in proc.stderr
            assert "no mixed-precision problems found" not in proc.stderr
        else:
            assert "no mixed-precision problems found in 4 steps" in proc.stderr


def test_a_script_that_calls_attach_under_ampdoctor_run_is_reported_once(tmp_path):
    script = with_attach(tmp_path, "seed.py", "ampdoctor.attach()")
    proc = python("-m", "ampdoctor.ui.cli", "run", str(script), "3")
    assert proc.returncode == 1
    assert proc.stderr.count("ampdoctor findings") == 1


def _train(model: torch.nn.Module, steps: int = 12) -> bytes:
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(32, 8), torch.randn(32, 2)
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _hooks() -> tuple:
    import torch.optim.optimizer as o
    from torch.nn.modules import module as m

    return (len(m._global_forward_pre_hooks), len(m._global_forward_hooks), len(o._global_optimizer_pre_hooks),
            dict(vars(torch.amp.GradScaler)), sys.excepthook, sys.exit)


def test_as_a_context_manager_training_is_bitwise_the_same_and_no_hook_is_left(tmp_path, capsys):
    plain = _train(_model())
    before = _hooks()
    with attach(json_path=tmp_path / "r.json", every=1) as attached:
        watched = _train(_model())
    assert watched == plain
    assert _hooks() == before
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] is True and report["findings"] == [] and report["watch"]["steps"] == 12
    assert attached.report.ok and attached.ended
    assert "no mixed-precision problems found in 12 steps" in capsys.readouterr().err


def test_an_exception_in_the_block_is_explained_and_goes_on_without_ampdoctor_s_frames(capsys):
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients") as raised:
        with attach(watch=False) as attached:
            _train(_model().half(), steps=1)
    assert attached.report.codes()[:1] == ["AMP101"]
    assert "AMP101 error" in capsys.readouterr().err
    files = [entry.path for entry in raised.traceback]   # the user's frames and torch's, none of ampdoctor's
    assert files[0] == Path(__file__) and "_train" in [entry.name for entry in raised.traceback]
    assert str(Path(torch.__file__).parent / "amp" / "grad_scaler.py") in map(str, files)
    assert not [f for f in files if str(f).startswith(str(Path(SRC) / "ampdoctor"))], files


def test_bad_arguments_are_refused_at_the_call(tmp_path):
    with pytest.raises(UsageError, match=r"json_path='.*' is a folder; give a file name, e\.g\. json_path='report"):
        attach(json_path=tmp_path)
    with pytest.raises(UsageError, match="every must be a positive number of steps, got 0"):
        attach(every=0)
    with attach(every=5) as first:
        assert attach(every=5) is first   # the same call again (a re-run cell): the attached run
        with pytest.raises(UsageError, match="already attached in this process"):
            attach(every=7)
