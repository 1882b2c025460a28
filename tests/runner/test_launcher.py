"""`ampdoctor run`: the script runs unchanged as __main__, crashes are explained, statuses are kept."""

import json
import os
import re

import pytest
import torch

from ampdoctor.core.report import Report
from ampdoctor.ui.cli import main

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def script(name):
    return os.path.join(SCRIPTS, name)


def losses(text):
    return [float(v) for v in re.findall(r"loss (\S+)", text)]


def test_seed_error_is_explained_with_every_fp16_parameter(capsys, tmp_path):
    out = tmp_path / "report.json"
    code = main(["run", "--no-watch", "--json", str(out), script("seed.py")])
    captured = capsys.readouterr()
    assert code == 1
    assert "ValueError: Attempting to unscale FP16 gradients." in captured.err  # original traceback kept
    report = json.loads(out.read_text())
    assert report["exception"]["type"] == "ValueError"
    assert {"torch", "device", "bf16_supported"} <= set(report["environment"])
    amp101 = [f for f in report["findings"] if f["code"] == "AMP101"]
    assert amp101, report["findings"]
    named = " ".join(f["where"] + " " + f["detail"] for f in amp101)
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert name in named
    for finding in report["findings"]:
        assert {"code", "severity", "where", "detail", "title", "fix", "step"} <= set(finding)


def test_fix_trains_the_seed_script_unchanged(capsys):
    code = main(["run", "--fix", "--no-watch", script("seed.py"), "30"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    values = losses(captured.out)
    assert len(values) == 30 and all(v == v and v != float("inf") for v in values)
    assert values[-1] < values[0] * 0.5
    assert "upcast" in captured.err


@pytest.mark.parametrize("name", ["stray.py", "bf16_under_fp16.py"])
def test_fix_trains_stray_and_bf16_models(name, capsys):
    code = main(["run", "--fix", "--no-watch", script(name)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    values = losses(captured.out)
    assert len(values) == 30 and values[-1] < values[0]


def test_fix_adds_master_weights_to_a_half_model_without_autocast(capsys):
    code = main(["run", "--fix", "--no-watch", script("half_no_autocast.py")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "master" in captured.err
    values = losses(captured.out)
    assert values[-1] < values[0]


def test_stray_parameter_is_named_alone(capsys, tmp_path):
    out = tmp_path / "r.json"
    code = main(["run", "--no-watch", "--json", str(out), script("stray.py")])
    capsys.readouterr()
    assert code == 1
    report = json.loads(out.read_text())
    amp101 = [f for f in report["findings"] if f["code"] == "AMP101"]
    text = " ".join(f["where"] + " " + f["detail"] for f in amp101)
    assert "margin" in text and "body.weight" not in text


def test_unrelated_exception_passes_through_unchanged(capsys, tmp_path):
    out = tmp_path / "r.json"
    code = main(["run", "--json", str(out), script("unrelated_error.py")])
    captured = capsys.readouterr()
    assert code == 1
    assert "KeyError: 'learning_rate'" in captured.err
    assert 'lr = config["learning_rate"]' in captured.err
    assert "not a known mixed-precision failure" in " ".join(captured.err.split())  # wrapped at 80
    report = json.loads(out.read_text())
    assert report["exception"]["type"] == "KeyError"
    assert [f["code"] for f in report["findings"] if f["code"] != "AMP001"] == []


@pytest.mark.parametrize("status", ["0", "3"])
def test_exit_status_of_the_script_is_kept(status, capsys, tmp_path):
    out = tmp_path / "report.json"
    assert main(["run", "--json", str(out), script("exit_status.py"), status]) == int(status)
    err, report = " ".join(capsys.readouterr().err.split()), json.loads(out.read_text())
    if status == "0":
        assert report["ok"] and "exit_status" not in report
        assert "ampdoctor: no mixed-precision problems found" in err
    else:  # a script that stops itself (sys.exit after "Loss is nan") earned no all-clear, on the console or in JSON
        assert not report["ok"] and report["exit_status"] == 3 and report["findings"] == []
        sentence = ("the script exited with status 3 after 1 optimizer step, and ampdoctor found no mixed-precision "
                    "cause for it: this is no all-clear")
        assert report["why_not_ok"] == sentence and f"ampdoctor: {sentence}" in err
        assert "no mixed-precision problems found" not in err
        assert Report.from_dict(report).exit_status == 3


def test_missing_script_is_a_usage_error(capsys):
    assert main(["run", "no/such/train.py"]) == 2
    assert "no such script: 'no/such/train.py'" in capsys.readouterr().err


def test_run_leaves_no_global_hooks_behind(capsys):
    import torch.optim.optimizer as o
    from torch.nn.modules import module as m

    before = (len(m._global_forward_pre_hooks), len(m._global_forward_hooks), len(o._global_optimizer_pre_hooks),
              dict(vars(torch.amp.GradScaler)))
    main(["run", script("seed.py"), "3"])
    main(["run", "--fix", script("seed.py"), "3"])
    capsys.readouterr()
    after = (len(m._global_forward_pre_hooks), len(m._global_forward_hooks), len(o._global_optimizer_pre_hooks),
             dict(vars(torch.amp.GradScaler)))
    assert after == before


def test_minilm_fp16_lora_run_names_the_lora_parameters_and_nothing_else(capsys, tmp_path):
    out = tmp_path / "r.json"
    code = main(["run", "--no-watch", "--json", str(out), script("minilm_lora.py"), "created", "2"])
    capsys.readouterr()
    assert code == 1
    report = json.loads(out.read_text())
    assert report["exception"]["message"] == "Attempting to unscale FP16 gradients."
    amp101 = [f for f in report["findings"] if f["code"] == "AMP101"]
    named = re.findall(r"(base_model\.\S+) \(float16", " ".join(f["detail"] for f in amp101))
    assert len(set(named)) == 24  # r=8 LoRA A and B on query and value in 6 layers
    assert all(".lora_A." in n or ".lora_B." in n for n in named)
    everything = " ".join(f["where"] + " " + f["detail"] for f in report["findings"])
    assert "attention.self.query.weight" not in everything and "embeddings" not in everything


def test_fix_reapplies_after_a_validation_step_downcasts_minilm_lora(capsys):
    code = main(["run", "--fix", "--no-watch", script("minilm_lora.py"), "downcast", "6"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    values = losses(captured.out)
    assert len(values) == 6 and all(v == v for v in values)
    assert values[-1] < values[0]
    assert "upcast" in captured.err  # the re-applied fix is printed


@pytest.mark.parametrize("mode", ["per-param", "flat", "no-copy-back"])
def test_hand_written_fp32_master_weights_are_not_stale_tensors(mode, capsys, tmp_path):
    """Was a false error: fairseq/Megatron/apex-style fp32 copies stepped by the optimizer were reported as stale
    tensors the optimizer was built over by mistake (AMP301, error) and the fp16 model as never updated (AMP302).
    The pre-flight runs at the first forward, before any gradient; at the first optimizer step the copies have the
    gradients the script handed them, so both are taken back. Without the hand-over they are stale: both stay."""
    out = tmp_path / "report.json"
    code = main(["run", "--json", str(out), script("manual_master_weights.py"), mode])
    err = capsys.readouterr().err
    report = json.loads(out.read_text())
    codes = [f["code"] for f in report["findings"]]
    assert code == 0, err
    if mode == "no-copy-back":
        assert {"AMP301", "AMP302"} <= set(codes), codes
    else:
        assert codes == [] and report["ok"], err
        assert report["watch"]["steps"] == 6 and report["watch"]["gradients"]["params"], report["watch"]


def test_clip_grad_value_before_unscale_is_amp408_under_run(capsys, tmp_path):
    """Was a false all-clear: only clip_grad_norm_ was observed, and a loop that clipped the still-scaled gradients
    by value (every entry capped at 1/65536 of the limit) printed "no mixed-precision problems found"."""
    out = tmp_path / "report.json"
    assert main(["run", "--json", str(out), script("clip_value_scaled.py")]) == 0
    err = " ".join(capsys.readouterr().err.split())
    report = json.loads(out.read_text())
    assert [f["code"] for f in report["findings"]] == ["AMP408"], err
    assert "clip_grad_value_(clip_value=1.0) at clip_value_scaled.py:" in report["findings"][0]["detail"]
    # the clip returns no norm: none is reported
    assert "pre_clip_norm" not in report["watch"]["gradients"]
    assert "no mixed-precision problems found" not in err


def test_the_script_gets_an_absolute_file(tmp_path, monkeypatch, capsys):
    """As `python sub/train.py` does (3.9+): __file__ is absolute. Was relative under run, so a script that changes
    directory before opening a file next to itself failed only under ampdoctor. (argv[0] is absolute too: runpy
    sets it to the path it runs; Python leaves it as typed, and says its form depends on the system.)"""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "data.txt").write_text("hello")
    (tmp_path / "sub" / "probe.py").write_text(
        "import os, sys\nhere = os.path.dirname(__file__)\nos.chdir('/')\n"
        "print(os.path.isabs(__file__), sys.argv[0], open(os.path.join(here, 'data.txt')).read())\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--no-watch", os.path.join("sub", "probe.py")]) == 0
    assert capsys.readouterr().out.strip() == f"True {tmp_path / 'sub' / 'probe.py'} hello"


def test_an_exit_after_the_dense_start_says_how_to_look_at_every_step(capsys, tmp_path):
    # the watch looked at the activations of the first 10 steps only: the sentence says how to see the others
    out = tmp_path / "report.json"
    assert main(["run", "--json", str(out), script("exit_status.py"), "3", "12"]) == 3
    why = json.loads(out.read_text())["why_not_ok"]
    assert why.startswith("the script exited with status 3 after 12 optimizer steps, and ampdoctor found no")
    assert why.endswith("this is no all-clear (`--activations --every 1` looks at the activations of every step)")
    assert main(["run", "--activations", "--every", "1", "--json", str(out), script("exit_status.py"), "3", "12"]) == 3
    assert json.loads(out.read_text())["why_not_ok"].endswith("this is no all-clear"), capsys.readouterr().err


def test_fix_says_when_it_has_nothing_to_repair(capsys):
    # AMP408 (clipping the still-scaled gradients) is fixed in the script: --fix used to stay silent about it
    assert main(["run", "--fix", script("clip_value_scaled.py")]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "ampdoctor --fix changed nothing: AMP408 has no automatic repair; its fix is in the script" in err
    assert main(["run", "--fix", "--no-watch", script("seed.py"), "3"]) == 0   # it did repair: no such line
    assert "changed nothing" not in capsys.readouterr().err


def test_a_second_model_is_named_after_the_scripts_name_for_it_once(capsys, tmp_path):
    """Two models: names start with the script's names for them. The crash explanation is made after the script's
    module is gone; it named the same parameters after their class, and each AMP101 came twice."""
    out = tmp_path / "report.json"
    assert main(["run", "--no-watch", "--json", str(out), script("two_models_one_half.py")]) == 1
    capsys.readouterr()
    report = json.loads(out.read_text())
    wheres = [f["where"] for f in report["findings"] if f["code"] == "AMP101"]
    assert wheres == ["text_encoder.0"], wheres
    assert "every one of text_encoder's, while the other models train in float32" in report["findings"][0]["detail"]


@pytest.mark.parametrize("mode", ["late", "half"])
def test_a_free_standing_parameter_is_no_stale_tensor(mode, capsys, tmp_path):
    """Was a false AMP301 error: a logit scale trained next to the model's own parameters (all in the optimizer) was
    called a stale copy from an optimizer built before .to()/.half(). ``run`` takes AMP301 back at the first optimizer
    step only for tensors that have a gradient by then: not for one first used after a warm-up (``late``), nor when
    the seed error ends the run before any optimizer step (``half``, whose AMP101 stays)."""
    out = tmp_path / "report.json"
    code = main(["run", "--json", str(out), script("free_parameter.py"), mode])
    err = capsys.readouterr().err
    codes = [f["code"] for f in json.loads(out.read_text())["findings"]]
    assert "AMP301" not in codes, err
    assert (code, "AMP101" in codes) == ((1, True) if mode == "half" else (0, False)), err


@pytest.mark.parametrize("held", ["main", "list", "wrapped"])
def test_models_are_named_as_the_script_holds_them_in_findings_and_watch(held, capsys, tmp_path):
    """Was ``Sequential[1].2`` in the findings (and ``Sequential[0]`` for the same model in the watch's table, which
    put the model it follows first): two models of one class local to main(), in a list at module level, or bound
    to names as their DataParallel wrappers."""
    out = tmp_path / "report.json"
    assert main(["run", "--every", "1", "--json", str(out), script("models_in_main.py"),
                 *([held] if held != "main" else [])]) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    encoder, decoder = ("models[0]", "models[1]") if held == "list" else ("encoder", "decoder")
    assert [(f["code"], f["where"]) for f in report["findings"]] == [("AMP302", f"{decoder}.2")]
    assert f"{decoder}.2.bias (float32, [8])" in report["findings"][0]["detail"]
    assert set(report["watch"]["gradients"]["params"]) == {f"{encoder}.0.weight", f"{encoder}.0.bias",
                                                           f"{encoder}.2.weight", f"{encoder}.2.bias",
                                                           f"{decoder}.0.weight", f"{decoder}.0.bias",
                                                           f"{decoder}.2.weight"}
