"""``ampdoctor advise`` through ``advise_main``, in-process."""

from __future__ import annotations

import json

from helpers_advise import write_config

from ampdoctor.ui.advise_command import main


def test_a_config_folder_gives_the_table_and_the_json(tmp_path, capsys):
    write_config(tmp_path)
    out = tmp_path / "advice.json"
    assert main([str(tmp_path), "--batch-size", "2", "--seq-len", "16", "--budget", "1GiB", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["parameters"] == 98_624  # 2 * 128 * 64 (embed, head) + 2 * 41,088 + 64 and data["budget"] == 2**30
    assert data["recommendation"]["strategy"] == "amp_bf16"
    printed = capsys.readouterr().out
    assert "amp_bf16" in printed and "recommended: amp_bf16" in printed


def test_a_factory_is_imported_and_built_on_meta(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodels.py").write_text(
        "import torch\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 1))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "a.json"
    assert main(["mymodels:build", "--seq-len", "3", "--optimizer", "sgd", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["parameters"] == 241


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "neither a folder" in capsys.readouterr().err
    write_config(tmp_path)
    assert main([str(tmp_path), "--budget", "lots"]) == 2
    assert "24GiB" in capsys.readouterr().err
    assert main([str(tmp_path), "--log", str(tmp_path / "nope.jsonl")]) == 2
