"""On the defaults (no --every, no --activations) a short run is diagnosed, and every output tells the same story."""

import json
import math
import os
import re

import pytest
from strict_json_check import strict_loads

from ampdoctor.core.records import read_log, read_recording
from ampdoctor.core.report import Report
from ampdoctor.ui.cli import main

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def test_a_ten_step_forward_overflow_is_named_and_every_output_agrees(tmp_path, capsys):
    out, log, html = tmp_path / "report.json", tmp_path / "logs", tmp_path / "report.html"
    code = main(["run", "--json", str(out), "--log-dir", str(log), os.path.join(SCRIPTS, "short_overflow.py")])
    err = capsys.readouterr().err
    assert code == 0
    report = json.loads(out.read_text())
    findings = {f["code"]: f for f in report["findings"]}
    # the layer is named without --activations: the first skip armed the activation monitor for one step
    assert findings["AMP601"]["where"] == "1.wo (Linear)"
    assert {"AMP603", "AMP612"} <= set(findings)   # every step skipped: AMP612 (AMP604 would repeat it)
    scale = report["watch"]["scale"]
    assert (report["watch"]["steps"], scale["steps"], scale["skipped"]) == (10, 10, 10)
    # the console summary was taken after the final flush: the same numbers
    assert "skipped 10 of 10 steps" in " ".join(err.split())
    assert "no mixed-precision problems found" not in err and "nothing was checked" not in err
    # each finding is printed once: in the one findings table
    assert len(re.findall(r"^AMP601 (?:error|warning|info)\b", err, re.MULTILINE)) == 1 and "watch findings" not in err
    # the flight recorder ends with the same report, and `ampdoctor report` shows it
    _, records, problems = read_log(log)
    assert problems == []
    end = next(r for r in records if r["type"] == "end")
    assert (end["steps"], end["summary"]["scale"]["skipped"]) == (10, 10)
    final = next(r for r in records if r["type"] == "report")["report"]
    assert [f["code"] for f in final["findings"]] == [f["code"] for f in report["findings"]]
    assert main(["report", str(log), "--html", str(html)]) == 0  # findings alone never fail a command
    shown = capsys.readouterr().out
    page = html.read_text()
    assert "AMP601" in shown and "No findings." not in page
    assert all(code in page for code in ("AMP601", "AMP603", "AMP612"))


def test_a_run_whose_gradients_go_nonfinite_writes_strict_json_and_reads_it_back(tmp_path, capsys):
    out, log = tmp_path / "report.json", tmp_path / "logs"
    assert main(["run", "--json", str(out), "--log-dir", str(log), os.path.join(SCRIPTS, "short_overflow.py")]) == 0
    capsys.readouterr()
    report = strict_loads(out.read_text())
    lines = [strict_loads(line) for line in (log / "ampdoctor.jsonl").read_text().splitlines()]
    assert [line["type"] for line in lines] == ["header", *["step"] * 10, "end", "report"]
    assert report["watch"]["gradients"]["global_norm"] == "nan"   # every step's gradients are inf/NaN
    assert lines[1]["loss"]["value"] == "nan" and lines[-1]["report"] == report
    read = Report.from_dict(report).watch.gradients
    assert math.isnan(read.global_norm) and read.modules["1.wo"].min_nonzero == math.inf
    recording = read_recording(*read_log(log)[:2])
    assert len(recording.steps) == 10 and all(not math.isfinite(s.loss.value) and math.isnan(s.gradients.global_norm)
                                              for s in recording.steps)   # losses nan, or inf
    assert main(["report", str(log)]) == 0
    shown = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(shown) if line.startswith("step "))
    assert "global grad norm" in shown[header] and shown[header + 1].split()[3] == "nan"   # step 0's, as before


def test_nan_in_the_data_is_reported_as_bad_input_on_the_defaults(tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["run", "--json", str(out), os.path.join(SCRIPTS, "nan_input.py")])
    capsys.readouterr()
    assert code == 0
    report = json.loads(out.read_text())
    codes = [f["code"] for f in report["findings"]]
    assert "AMP609" in codes and "AMP601" not in codes
    [bad] = [f for f in report["findings"] if f["code"] == "AMP609"]
    # step 2, the first bad batch: the watch looks at activations through its first 10 steps (an escalation after
    # step 2's skip would have looked at step 3 only)
    assert bad["where"] == "model input" and bad["step"] == 2


def test_nan_in_the_very_first_batch_is_bad_input_not_the_first_layer(tmp_path, capsys):
    # ampdoctor run attaches the watch during the first forward, after the model's input went by: step 0's record
    # has no inputs and blamed the first Linear (AMP601); the next step shows the input. Only AMP609 is true.
    out = tmp_path / "report.json"
    assert main(["run", "--json", str(out), os.path.join(SCRIPTS, "nan_input.py"), "0"]) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    assert "AMP601" not in [f["code"] for f in report["findings"]]
    assert [f["where"] for f in report["findings"] if f["code"] == "AMP609"] == ["model input"]
    assert report["watch"]["activations"]["first_nonfinite_forward"]["module"] == "(input)"


def test_a_crash_is_printed_once_without_an_empty_watch_summary(tmp_path, capsys):
    code = main(["run", os.path.join(SCRIPTS, "seed.py")])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("ValueError: Attempting to unscale FP16 gradients.") == 1   # the traceback's own line
    assert "loss scale -" not in err and "0 steps" not in err


def test_an_overflow_in_a_modules_own_code_is_blamed_on_that_module_not_the_next_linear(tmp_path, capsys):
    # The watch attaches during the first forward, so the first non-finite step has no saved inputs to re-run.
    # It used to report AMP601 at '0.proj (Linear)' from that step and never look again; now the next sampled
    # step's re-run replaces it and names the op and the module whose own code made the inf.
    out = tmp_path / "report.json"
    for activations in ([], ["--activations"]):
        assert main(["run", *activations, "--json", str(out), os.path.join(SCRIPTS, "overflow_in_own_code.py")]) == 0
        amp601 = [f for f in json.loads(out.read_text())["findings"] if f["code"] == "AMP601"]
        assert [f["where"] for f in amp601] == ["0 (Scores)"], amp601
        assert "aten.exp.default in '0' (Scores)" in amp601[0]["detail"]
        assert "The first module with a non-finite output was 0.proj (Linear)" in amp601[0]["detail"]
    capsys.readouterr()


def test_a_gans_generator_overflow_is_named_not_blamed_on_the_critics_input(tmp_path, capsys):
    """The watch follows the critic's optimizer; the generator's last layer overflows fp16 and its fake batch feeds
    the critic. The look at the forward covers both models: the first inf in call order is netG.2's output, re-run
    to the op, and the critic's inf input is no bad data (it said AMP609 'the data produced it')."""
    out = tmp_path / "report.json"
    assert main(["run", "--json", str(out), os.path.join(SCRIPTS, "gan_overflow.py"), "generator"]) == 0
    capsys.readouterr()
    findings = {f["code"]: f for f in json.loads(out.read_text())["findings"]}
    assert "AMP609" not in findings and {"AMP601", "AMP603", "AMP612"} <= set(findings)
    assert findings["AMP601"]["where"] == "netG.2 (Linear)" and "aten.addmm" in findings["AMP601"]["detail"]
    assert "First module with a non-finite output: netG.2 (Linear)." in " ".join(findings["AMP603"]["detail"].split())


def test_a_nan_in_a_gans_noise_is_bad_input_of_the_generator(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["run", "--json", str(out), os.path.join(SCRIPTS, "gan_overflow.py"), "data"]) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    findings = {f["code"]: f for f in report["findings"]}
    assert "AMP601" not in findings and findings["AMP609"]["where"] == "netG input"
    assert "an input tensor of netG holds NaN" in findings["AMP609"]["detail"]
    assert "The model's input already held inf/NaN" in " ".join(findings["AMP603"]["detail"].split())
    assert report["watch"]["activations"]["first_nonfinite_forward"]["module"] == "(input of netG)"


def test_a_gans_critic_overflow_is_still_named(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["run", "--json", str(out), os.path.join(SCRIPTS, "gan_overflow.py"), "critic"]) == 0
    capsys.readouterr()
    findings = {f["code"]: f for f in json.loads(out.read_text())["findings"]}
    assert "AMP609" not in findings and findings["AMP601"]["where"] == "netD.2 (Linear)"


def test_a_frozen_fp16_teachers_overflow_is_named_in_the_teacher(tmp_path, capsys):
    """Every output of the trained student is finite; the loss reads the frozen fp16 teacher's inf logits. The look
    at the forward covers the models that ran a forward with nothing to train: AMP601 names the teacher's layer and
    the op, not the student and not the loss. Inf weights of a frozen model are no optimizer step's doing."""
    out = tmp_path / "report.json"
    assert main(["run", "--json", str(out), os.path.join(SCRIPTS, "fp16_teacher.py"), "overflow"]) == 0
    capsys.readouterr()
    findings = {f["code"]: f for f in json.loads(out.read_text())["findings"]}
    assert "AMP609" not in findings and findings["AMP601"]["where"] == "teacher.2 (Linear)"
    assert "aten.addmm.default in 'teacher.2'" in findings["AMP601"]["detail"]
    assert "teacher.to(torch.bfloat16)" in findings["AMP601"]["fix"]   # its weights are half: no autocast to leave
    assert main(["run", "--json", str(out), os.path.join(SCRIPTS, "fp16_teacher.py"), "weights"]) == 0
    capsys.readouterr()
    findings = {f["code"]: f for f in json.loads(out.read_text())["findings"]}
    assert findings["AMP601"]["where"] == "teacher.2 (Linear)"
    assert "nothing trains them" in findings["AMP601"]["detail"] and "optimizer step wrote" not in \
        findings["AMP601"]["detail"]
    assert findings["AMP601"]["fix"].startswith("# its weights were inf/NaN already, and nothing trains them")


def test_a_loss_made_nan_outside_the_watched_model_points_at_what_else_it_reads():
    """A watch given only the student (no run to find the teacher): every output it saw was finite, so AMP613 and
    AMP603 say the inf/NaN come from the loss or another tensor it reads, not from a module."""
    import torch
    from torch import nn

    import ampdoctor

    torch.manual_seed(0)
    teacher = nn.Linear(16, 10).half().requires_grad_(False)
    with torch.no_grad():
        teacher.weight.mul_(1e4)
    student = nn.Linear(16, 10)
    opt, scaler = torch.optim.SGD(student.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    with ampdoctor.watch(student, opt, scaler) as w:
        for _ in range(10):
            x = torch.randn(32, 16)
            with torch.no_grad():
                target = teacher(x.half() * 100).float()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.kl_div(student(x).float().log_softmax(-1), target.softmax(-1),
                                            reduction="batchmean")
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    findings = {f.code: f for f in w.findings()}
    assert "AMP601" not in findings and {"AMP603", "AMP613"} <= set(findings)
    assert "frozen teacher's" in findings["AMP603"].detail and "frozen teacher's" in findings["AMP613"].detail
    assert "a frozen teacher's or encoder's fp16 output" in findings["AMP613"].fix


def test_an_fp16_vae_overflow_is_named_by_its_path_in_the_vae(tmp_path, capsys):
    """diffusers' real AutoencoderKL, frozen in fp16, encodes the batch under no_grad through ``vae.encode()``: the
    look names the encoder's convolution as the script reaches it (``vae.encoder.conv_out``), and the denoiser's
    first layer, which only carried the inf along on the step the watch attached in, is not named."""
    pytest.importorskip("diffusers")
    out = tmp_path / "report.json"
    assert main(["run", "--json", str(out), os.path.join(SCRIPTS, "vae_fp16.py")]) == 0
    capsys.readouterr()
    findings = [f for f in json.loads(out.read_text())["findings"] if f["code"] in ("AMP601", "AMP609")]
    assert [f["where"] for f in findings] == ["vae.encoder.conv_out (Conv2d)"]
    assert "aten.convolution.default in 'vae.encoder.conv_out'" in findings[0]["detail"]
    assert "vae.encoder.to(torch.bfloat16)" in findings[0]["fix"] and "sdxl-vae-fp16-fix" in findings[0]["fix"]
