"""What a real flight recorder says about fp16/bf16, read back by advise."""

from __future__ import annotations

import math

import torch
from torch import nn

import ampdoctor
from ampdoctor.advice import advise
from ampdoctor.advice.evidence import read_evidence


def _fp32_run(log_dir, scale=1e-6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdoctor.watch(model, opt, every=1, log_dir=str(log_dir)):
        (model(torch.randn(8, 16)).pow(2).sum() * scale).backward()
        grads = {n: p.grad.detach().abs().clone() for n, p in model.named_parameters()}
        opt.step()
    return model, grads


def test_fp16_needs_the_loss_scale_the_real_gradients_need(tmp_path):
    model, grads = _fp32_run(tmp_path)
    largest = max(g.max().item() for g in grads.values())
    need = {n: math.ceil(math.log2(2**-24 / max(g[g > 0].min().item(), largest * 2**-24))) for n, g in grads.items()}
    evidence = read_evidence(str(tmp_path / "ampdoctor.jsonl"))
    assert evidence["fp16"]["needed_scale_log2"] == max(need.values()) > 0
    assert evidence["fp16"]["allowed_scale_log2"] == math.floor(math.log2(65504 / largest))
    assert evidence["safe"] == {"fp16": True, "bf16": True, "pure_bf16": None}
    assert any("bf16 loses none" in line for line in evidence["lines"])
    assert any("not in the log" in line for line in evidence["lines"])  # fp32 params: no lost-update measurement


def test_pure_bf16_lost_updates_are_read_and_block_the_pure_bf16_advice(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(64, 64).bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)  # updates far below half an ulp of the weights
    with ampdoctor.watch(model, opt, every=1, log_dir=str(tmp_path)) as w:
        for _ in range(2):
            model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
            opt.step()
            opt.zero_grad()
    measured = w.summary_data()["lost_updates"]
    evidence = read_evidence(str(tmp_path / "ampdoctor.jsonl"))
    assert evidence["lost_updates"]["mean"] > 0.5
    assert abs(evidence["lost_updates"]["mean"] - measured["lost_fraction"]) < 0.05
    assert evidence["safe"]["pure_bf16"] is False
    advice = advise(nn.Linear(64, 64), batch_size=4, seq_len=1, budget=10**9, log=str(tmp_path / "ampdoctor.jsonl"),
                    activations=False)
    assert advice.evidence["lost_updates"]["mean"] == evidence["lost_updates"]["mean"]
    assert advice.recommendation["strategy"] != "pure_bf16"


def test_a_budget_that_only_lora_fits_recommends_lora_with_recipes(tmp_path):
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    full = advise(model, batch_size=2, seq_len=4)
    lora_total = full.strategy("lora")["bytes"]["total"]
    advice = advise(model, batch_size=2, seq_len=4, budget=lora_total)
    assert advice.recommendation["strategy"] == "lora"
    assert set(advice.recommendation["recipes"]) == {"torch", "accelerate", "lightning", "trainer"}
    assert all(row["fits"] is (row["bytes"]["total"] <= lora_total) for row in advice.strategies)
