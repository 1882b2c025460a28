"""The code or flags that set up each strategy in plain PyTorch, accelerate, Lightning and the HF Trainer.

Each line of code is short enough to be shown indented in 80 columns without breaking it (a comment may be
continued under its ``#``); a recipe of several statements has one per line.
"""

from __future__ import annotations

__all__ = ["recipe", "FRAMEWORKS", "DEVICES"]

FRAMEWORKS = ("torch", "accelerate", "lightning", "trainer")
DEVICES = ("cuda", "cpu")

_AUTOCAST = ("with torch.autocast('{device}', dtype=torch.{dtype}):\n"
             "    loss = model(batch).loss\n")
_AMP = {
    "torch": {
        "bf16": _AUTOCAST + "loss.backward(); optimizer.step(); optimizer.zero_grad()",
        "fp16": ("scaler = torch.amp.GradScaler('{device}')  # once, before the loop\n" + _AUTOCAST
                 + "scaler.scale(loss).backward()\n"
                   "scaler.step(optimizer); scaler.update(); optimizer.zero_grad()"),
    },
    "accelerate": "accelerator = Accelerator(mixed_precision='{short}')",
    "lightning": "Trainer(precision='{lightning}-mixed')",  # Lightning names fp16 '16-mixed'
    "trainer": "TrainingArguments(..., {short}=True)",
}
_NOTES = {
    "amp_bf16_checkpoint": {
        "torch": "model.{checkpointing}()  # transformers\n"
                 "# any other model: per block, in its parent's forward:\n"
                 "# x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)",
        "accelerate": "model.{checkpointing}()",
        "lightning": "model.{checkpointing}()  # in configure_model()",
        "trainer": "TrainingArguments(..., bf16=True, gradient_checkpointing=True)",
    },
    "amp_bf16_adamw8bit": {
        "torch": "import bitsandbytes as bnb\n"
                 "optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=lr)",
        "accelerate": "optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=lr)  # then accelerator.prepare",
        "lightning": "def configure_optimizers(self):\n"
                     "    return bnb.optim.AdamW8bit(self.parameters(), lr=lr)",
        "trainer": "TrainingArguments(..., bf16=True, optim='adamw_bnb_8bit')",
    },
    "fp16_master": {
        "torch": "model.half()\n"
                 "optimizer = ampdoctor.MasterWeights(torch.optim.AdamW(model.parameters()))\n"
                 "scaler = torch.amp.GradScaler('{device}')  # scaler.scale(loss).backward(); scaler.step(optimizer)",
        "accelerate": "optimizer = ampdoctor.MasterWeights(optimizer)  # before accelerator.prepare; fp16 model",
        "lightning": "Trainer(precision='16-true')  # configure_optimizers returns ampdoctor.MasterWeights(...)",
        "trainer": "ampdoctor run --fix train.py  # wraps the Trainer's optimizer in MasterWeights",
    },
    "pure_bf16": {
        "torch": "model.to(torch.bfloat16)  # optimizer states follow; add Kahan summation or stochastic rounding "
                 "(e.g. torchao's _AdamW(bf16_stochastic_round=True))",
        "accelerate": "model.to(torch.bfloat16)  # before accelerator.prepare, with mixed_precision='no'",
        "lightning": "Trainer(precision='bf16-true')",
        "trainer": "model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16)\n"
                   "TrainingArguments(..., bf16=False)",
    },
    "lora": {
        "torch": "from peft import LoraConfig, get_peft_model\n"
                 "model = get_peft_model(model.to(torch.bfloat16), LoraConfig(r={rank}))  # adapters fp32 "
                 "(autocast_adapter_dtype=True)",
        "accelerate": "model = get_peft_model(model, LoraConfig(r={rank}))\n"
                      "accelerator = Accelerator(mixed_precision='bf16')",
        "lightning": "model = get_peft_model(model, LoraConfig(r={rank}))  # in configure_model()\n"
                     "Trainer(precision='bf16-mixed')",
        "trainer": "model = get_peft_model(model, LoraConfig(r={rank}))\n"
                   "TrainingArguments(..., bf16=True)",
    },
    "fsdp": {"torch": "policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)\n"
                      "for block in blocks:  # each repeated block, then the whole model\n"
                      "    fully_shard(block, mp_policy=policy)\n"
                      "fully_shard(model, mp_policy=policy)",
             "accelerate": "accelerate launch --use_fsdp --fsdp_version 2 \\\n"
                           "    --mixed_precision bf16 train.py",
             "lightning": "Trainer(strategy=FSDPStrategy(...), precision='bf16-mixed')",
             "trainer": "TrainingArguments(..., fsdp='full_shard auto_wrap', bf16=True)"},
}
# ZeRO stage 1, 2 or 3 (DeepSpeed; plain PyTorch has stage 1 only, as ZeroRedundancyOptimizer)
_ZERO = {
    "torch": ("model, optimizer, _, _ = deepspeed.initialize(model=model, config={{\n"
              "    'zero_optimization': {{'stage': {stage}}}, 'bf16': {{'enabled': True}}}})"),
    "accelerate": "accelerate launch --use_deepspeed --zero_stage {stage} \\\n    --mixed_precision bf16 train.py",
    "lightning": "Trainer(strategy='deepspeed_stage_{stage}', precision='bf16-mixed')",
    "trainer": ("TrainingArguments(..., bf16=True, deepspeed={{\n"
                "    'zero_optimization': {{'stage': {stage}}}, 'bf16': {{'enabled': True}}}})"),
}


def recipe(key: str, rank: int = 8, device: str = "cuda") -> dict[str, str]:
    """Return ``{framework: code or flags}`` for strategy ``key``, training on ``device`` (``"cuda"``, ``"cpu"``).

    >>> recipe("amp_bf16")["trainer"]
    'TrainingArguments(..., bf16=True)'
    >>> recipe("amp_bf16", device="cpu")["torch"].splitlines()[0]
    "with torch.autocast('cpu', dtype=torch.bfloat16):"
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if key == "fp32":
        return {"torch": "model.float()  # no autocast", "accelerate": "Accelerator(mixed_precision='no')",
                "lightning": "Trainer(precision='32-true')", "trainer": "TrainingArguments(...)  # no fp16/bf16"}
    short = "fp16" if key in ("amp_fp16", "fp16_master") else "bf16"
    amp = {f: (t[short] if isinstance(t, dict) else t).format(
        device=device, dtype="float16" if short == "fp16" else "bfloat16", short=short,
        lightning="16" if short == "fp16" else "bf16") for f, t in _AMP.items()}
    if key in ("amp_fp16", "amp_bf16"):
        return amp
    if key in ("zero1", "zero2", "zero3"):
        zero = {f: t.format(stage=key[-1]) for f, t in _ZERO.items()}
        if key == "zero1":
            zero["torch"] = "torch.distributed.optim.ZeroRedundancyOptimizer(params, torch.optim.AdamW)"
        return zero
    extra = _NOTES.get(key)
    if extra is None:
        raise ValueError(f"no recipe for strategy {key!r}")
    if key.startswith("amp_bf16_"):
        fill = {"checkpointing": _checkpointing_method()} if key == "amp_bf16_checkpoint" else {}
        # the setup first, then the AMP loop; the Trainer's flags in one TrainingArguments
        return {f: extra[f].format(**fill) + ("" if f == "trainer" else "\n" + amp[f]) for f in FRAMEWORKS}
    return {f: t.format(rank=rank, device=device) for f, t in extra.items()}


def _checkpointing_method() -> str:
    """Return the transformers method that turns on activation checkpointing, as the installed version names it.

    transformers 5 renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable`` and warns
    (FutureWarning, removal in v6) on the old name; older versions have only the old one.
    """
    try:
        from transformers import PreTrainedModel
    except ImportError:   # not installed: the name every version up to v6 accepts
        return "gradient_checkpointing_enable"
    if hasattr(PreTrainedModel, "activation_checkpointing_enable"):
        return "activation_checkpointing_enable"
    return "gradient_checkpointing_enable"
