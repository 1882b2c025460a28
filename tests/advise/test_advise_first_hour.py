"""What a newcomer meets in a first run of ``ampdoctor advise``: a long path, a pipe, a CPU, transformers' warnings.

The output is read as printed: through ``main`` with stdout captured (a pipe: rich's 80 columns, no terminal), or
drawn by a rich console of a given width, as ``rich.print(advice)`` draws it on a terminal.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from helpers_advise import TINY_LLAMA, write_config
from rich.console import Console
from torch import nn

from ampdoctor.advice import advise
from ampdoctor.advice.recipes import recipe
from ampdoctor.advice.states import STRATEGIES
from ampdoctor.ui.advise_command import main

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LONG = "meta-llama-tiny-llama-1.1b-chat-v1.0-checkpoints-from-the-cluster-scratch-volume"


@pytest.fixture
def long_config(tmp_path):
    folder = tmp_path / "models" / LONG
    folder.mkdir(parents=True)
    return write_config(folder)


def _printed(capsys, monkeypatch, *argv, terminal=False, columns=80):
    """The lines ``ampdoctor advise ARGV`` prints: piped, or on a terminal of ``columns`` (styles taken out)."""
    monkeypatch.setenv("COLUMNS", str(columns))
    if terminal:
        monkeypatch.setenv("FORCE_COLOR", "1")   # rich: a terminal
    assert main([*argv]) == 0
    return [ANSI.sub("", line) for line in capsys.readouterr().out.splitlines()]


def _on_terminal(advice, width=80):
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=True, color_system=None).print(advice)
    return out.getvalue().splitlines()


def test_a_long_path_is_printed_whole_on_one_line(long_config, capsys, monkeypatch):
    assert len(str(long_config)) > 80
    for terminal in (False, True):
        printed = _printed(capsys, monkeypatch, str(long_config), "--seq-len", "8", "--no-activations",
                           terminal=terminal)
        assert any(str(long_config) in line for line in printed), "\n".join(printed)


def test_no_line_ends_in_a_space(long_config, capsys, monkeypatch):
    for terminal in (False, True):
        printed = _printed(capsys, monkeypatch, str(long_config), "--seq-len", "8", "--budget", "1GiB",
                           "--no-activations", terminal=terminal)
        assert len(printed) > 20 and [line for line in printed if line != line.rstrip()] == []


def test_every_line_fits_80_columns_and_the_code_is_shown_whole(long_config, capsys, monkeypatch):
    advice = advise(long_config, seq_len=8, budget="1GiB", activations=False)
    for strategy in STRATEGIES:
        advice.recommendation.update(strategy=strategy.key, title=strategy.title,
                                     recipes=recipe(strategy.key, 8))
        drawn = _on_terminal(advice)
        too_wide = [line for line in drawn if len(line) > 80 and str(long_config) not in line]
        assert too_wide == [], strategy.key
        shown = [line.strip() for line in drawn]
        for code in advice.recommendation["recipes"].values():
            for line in code.splitlines():
                statement = line.partition("  #")[0].strip()   # a long comment may go on under its "#"
                assert any(statement in s for s in shown), (strategy.key, statement)
    # a terminal narrower than the table: the names are not cut to 'amp_…'
    table = _printed(capsys, monkeypatch, str(long_config), "--seq-len", "8", "--no-activations", terminal=True,
                     columns=50)
    assert any(line.startswith("amp_bf16_checkpoint ") for line in table), "\n".join(table)


def test_the_code_is_indented_as_python_under_its_framework(long_config):
    advice = advise(long_config, seq_len=8, budget="1GiB", activations=False)
    assert advice.recommendation["strategy"] == "amp_bf16"
    drawn = _on_terminal(advice)
    at = drawn.index("  torch:")
    assert drawn[at + 1].startswith("    with torch.autocast(") and drawn[at + 1].endswith("dtype=torch.bfloat16):")
    assert drawn[at + 2:at + 4] == ["        loss = model(batch).loss",
                                    "    loss.backward(); optimizer.step(); optimizer.zero_grad()"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_recommended_code_runs_on_the_cpu():
    advice = advise(nn.Linear(64, 64), batch_size=2, seq_len=4, activations=False)
    assert advice.device["device"] == "cpu"
    code = advice.recommendation["recipes"]["torch"]
    assert "torch.autocast('cpu'" in code and "cuda" not in code


def test_asking_for_the_cpu_gives_cpu_code_on_any_machine(tmp_path, capsys, monkeypatch):
    advice = advise(nn.Linear(64, 64), batch_size=2, seq_len=4, activations=False, device="cpu")
    assert advice.device["device"] == "cpu"
    assert "cuda" not in json.dumps(advice.recommendation["recipes"])
    for key in ("amp_fp16", "fp16_master"):   # the GradScaler too
        code = recipe(key, 8, "cpu")["torch"]
        assert "GradScaler('cpu')" in code and "cuda" not in code
    config = write_config(tmp_path)
    printed = "\n".join(_printed(capsys, monkeypatch, str(config), "--seq-len", "8", "--no-activations",
                                 "--device", "cpu"))
    assert "torch.autocast('cpu'" in printed and "'cuda'" not in printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_where_there_is_none_is_a_usage_error(tmp_path, capsys):
    config = write_config(tmp_path)
    assert main([str(config), "--device", "cuda", "--no-activations"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "'cpu'" in err


def test_the_recipes_name_options_that_exist():
    for key in ("zero1", "zero2", "zero3"):
        for framework, code in recipe(key).items():
            assert "bf26" not in code and "bf36" not in code, (key, framework)
        assert f"stage': {key[-1]}" in recipe(key)["trainer"]
    assert recipe("amp_fp16")["lightning"] == "Trainer(precision='16-mixed')"   # Lightning has no 'fp16-mixed'
    for key in ("amp_bf16_checkpoint", "amp_bf16_adamw8bit"):
        assert recipe(key)["trainer"].count("TrainingArguments(") == 1
    # the fp16 loop scales the loss it backpropagates, and makes its scaler before the loop
    lines = recipe("amp_fp16")["torch"].splitlines()
    assert lines[0].startswith("scaler = torch.amp.GradScaler(") and "scaler.scale(loss).backward()" in lines
    assert "loss.backward()" not in "\n".join(lines).replace("scale(loss).backward()", "")


def test_advise_itself_raises_no_transformers_future_warning(tmp_path):
    pytest.importorskip("transformers")
    write_config(tmp_path, TINY_LLAMA)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")   # shown again even if an earlier test triggered it
        advice = advise(tmp_path, batch_size=2, seq_len=16)   # the checkpointed run turns on HF's checkpointing
    assert advice.strategy("amp_bf16_checkpoint")["bytes"]["activations"] > 0
    ours = [f"{w.category.__name__}: {w.message}" for w in caught
            if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert ours == []


def test_the_recommended_checkpointing_call_is_not_deprecated():
    transformers = pytest.importorskip("transformers")
    method = re.search(r"model\.(\w+_enable)\(\)", recipe("amp_bf16_checkpoint")["torch"]).group(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(model, method)()   # as the user runs it
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_a_piped_run_prints_nothing_on_stderr(tmp_path):
    pytest.importorskip("transformers")
    config = write_config(tmp_path)
    done = subprocess.run([sys.executable, "-m", "ampdoctor", "advise", str(config), "--batch-size", "2",
                           "--seq-len", "16"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    assert "recommended:" in done.stdout
    assert done.stderr == ""   # no FutureWarning, no transformers log line about use_cache
