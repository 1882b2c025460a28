"""Weights, gradients, optimizer state and master copies per strategy equal the real tensors' bytes, exactly."""

from __future__ import annotations

import pytest
import torch
from helpers_advise import TINY_LLAMA, nbytes, real_llama, state_bytes
from torch import nn

from ampdoctor import MasterWeights
from ampdoctor.advice import advise
from ampdoctor.advice.states import optimizer_bytes


def _train_step(model, optimizer, *, autocast=None, scaler=None):
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 16))
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = model(ids, labels=ids).loss
    loss.float().backward()
    grads = nbytes(p.grad for p in model.parameters())  # before the step: MasterWeights uses them up
    optimizer.step()
    optimizer.zero_grad()
    return grads


def _expected(advice, key):
    b = advice.strategy(key)["bytes"]
    return b["weights"], b["gradients"], b["optimizer_state"], b["master_weights"]


@pytest.fixture(scope="module")
def advice_adamw():
    return advise(real_llama(), batch_size=2, seq_len=16, activations=False)


@pytest.mark.parametrize("key,autocast", [("fp32", None), ("amp_fp16", torch.float16), ("amp_bf16", torch.bfloat16),
                                          ("amp_bf16_checkpoint", torch.bfloat16)])
def test_fp32_parameter_strategies_match_real_tensors(advice_adamw, key, autocast):
    model = real_llama()
    if key == "amp_bf16_checkpoint":
        if hasattr(model, "activation_checkpointing_enable"):   # transformers 5 deprecates the old name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grads = _train_step(model, opt, autocast=autocast)
    assert _expected(advice_adamw, key) == (nbytes(model.parameters()), grads, state_bytes(opt), 0)


def test_fp16_master_weights_match_real_tensors(advice_adamw):
    model = real_llama().half()
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3))
    _train_step(model, opt)
    grads = _train_step(model, opt)  # second step: fp32 gradients of the update phase
    assert _expected(advice_adamw, "fp16_master") == (nbytes(model.parameters()), grads, state_bytes(opt),
                                                      nbytes(opt.masters))
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_pure_bf16_matches_real_tensors(advice_adamw):
    model = real_llama().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grads = _train_step(model, opt)
    assert _expected(advice_adamw, "pure_bf16") == (nbytes(model.parameters()), grads, state_bytes(opt), 0)


def test_lora_counts_what_peft_builds(advice_adamw):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(real_llama().bfloat16(), peft.LoraConfig(r=8))  # adapters upcast to fp32
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32}
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    grads = _train_step(model, opt, autocast=torch.bfloat16)
    assert _expected(advice_adamw, "lora") == (nbytes(model.parameters()), grads, state_bytes(opt), 0)
    assert advice_adamw.lora["parameters"] == sum(p.numel() for p in trainable)
    assert "q_proj, v_proj" in advice_adamw.lora["rule"]


def test_sgd_momentum_state_matches_real_tensors():
    advice = advise(real_llama(), optimizer="sgd", activations=False)
    model = real_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    grads = _train_step(model, opt, autocast=torch.bfloat16)
    assert _expected(advice, "amp_bf16") == (nbytes(model.parameters()), grads, state_bytes(opt), 0)


def test_frozen_parameters_have_no_gradients_or_state():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    model[0].requires_grad_(False)
    advice = advise(model, batch_size=2, seq_len=3, activations=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(2, 3, 32)).sum().backward()
    grads = nbytes(p.grad for p in model.parameters())
    opt.step()
    assert advice.trainable == 132 and advice.parameters == 1188
    assert _expected(advice, "fp32") == (nbytes(model.parameters()), grads, state_bytes(opt), 0)
    assert model[0].weight.device.type == "cpu" and model[0].weight.grad is None  # the user's module untouched


def test_tied_weights_count_once():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert advise(model, activations=False).parameters == sum(p.numel() for p in model.parameters())


def test_8bit_optimizer_state_is_the_bitsandbytes_layout():
    # 2 uint8 states + one fp32 absmax per 256 entries for each; fp32 states under 4096 entries (the notes, §6.3)
    assert optimizer_bytes([4096 * 256], 4, "adamw8bit") == 2 * 4096 * 256 + 2 * 4 * 4096
    assert optimizer_bytes([4095], 2, "adamw8bit") == 8 * 4095
    ratio = optimizer_bytes([10**8], 4, "adamw8bit") / 10**8
    assert 2.03 <= ratio < 2.032


def test_sharded_rows_divide_the_stated_components():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    one = advise(model, activations=False, devices=1)
    eight = advise(model, activations=False, devices=8)
    assert "zero1" not in [r["key"] for r in one.strategies]
    psi = one.parameters
    z1, z2, z3 = (eight.strategy(k)["bytes"] for k in ("zero1", "zero2", "zero3"))
    assert (z1["weights"], z1["gradients"], z1["master_weights"]) == (2 * psi, 2 * psi, -(-4 * psi // 8))
    assert (z2["weights"], z2["gradients"]) == (2 * psi, -(-2 * psi // 8))
    assert z3["weights"] == -(-2 * psi // 8)
    assert z1["optimizer_state"] == z2["optimizer_state"] == z3["optimizer_state"] == -(-(8 * psi + 4 * 8) // 8)
