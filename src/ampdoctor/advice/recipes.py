"""The code or flags that set up each strategy in plain PyTorch, accelerate, Lightning and the HF Trainer."""

from __future__ import annotations

__all__ = ["recipe", "FRAMEWORKS"]

FRAMEWORKS = ("torch", "accelerate", "lightning", "trainer")

_AMP = {
    "torch": ("with torch.autocast('cuda', dtype=torch.{dtype}):\n    loss = model(batch).loss\n"
              "{scaler}loss.backward(); optimizer.step(); optimizer.zero_grad()"),
    "accelerate": "accelerator = Accelerator(mixed_precision='{short}')",
    "lightning": "Trainer(precision='{short}-mixed')",
    "trainer": "TrainingArguments(..., {short}=True)",
}
_NOTES = {
    "amp_bf16_checkpoint": {
        "torch": "model.gradient_checkpointing_enable()  # transformers; else wrap each block: "
                 "torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)",
        "accelerate": "model.gradient_checkpointing_enable()",
        "lightning": "model.gradient_checkpointing_enable()  # in configure_model()",
        "trainer": "TrainingArguments(..., gradient_checkpointing=True)",
    },
    "amp_bf16_adamw8bit": {
        "torch": "import bitsandbytes as bnb; optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=lr)",
        "accelerate": "optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=lr)  # then accelerator.prepare",
        "lightning": "def configure_optimizers(self): return bnb.optim.AdamW8bit(self.parameters(), lr=lr)",
        "trainer": "TrainingArguments(..., optim='adamw_bnb_8bit')",
    },
    "fp16_master": {
        "torch": "model.half(); optimizer = ampdoctor.MasterWeights(torch.optim.AdamW(model.parameters()))\n"
                 "scaler = torch.amp.GradScaler('cuda')  # scaler.scale(loss).backward(); scaler.step(optimizer)",
        "accelerate": "optimizer = ampdoctor.MasterWeights(optimizer)  # before accelerator.prepare; fp16 model",
        "lightning": "Trainer(precision='16-true') with configure_optimizers returning ampdoctor.MasterWeights(...)",
        "trainer": "ampdoctor run --fix train.py  # wraps the Trainer's optimizer in MasterWeights",
    },
    "pure_bf16": {
        "torch": "model.to(torch.bfloat16)  # optimizer states follow; add Kahan summation or stochastic rounding "
                 "(e.g. torchao's _AdamW(bf16_stochastic_round=True))",
        "accelerate": "model.to(torch.bfloat16) before accelerator.prepare (mixed_precision='no')",
        "lightning": "Trainer(precision='bf16-true')",
        "trainer": "model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16); TrainingArguments("
                   "bf16=False)",
    },
    "lora": {
        "torch": "from peft import LoraConfig, get_peft_model\nmodel = get_peft_model(model.to(torch.bfloat16), "
                 "LoraConfig(r={rank}))  # adapters fp32 (autocast_adapter_dtype=True)",
        "accelerate": "model = get_peft_model(model, LoraConfig(r={rank})); Accelerator(mixed_precision='bf16')",
        "lightning": "get_peft_model(...) in configure_model(); Trainer(precision='bf16-mixed')",
        "trainer": "get_peft_model(model, LoraConfig(r={rank})); TrainingArguments(..., bf16=True)",
    },
    "zero1": {"torch": "torch.distributed.optim.ZeroRedundancyOptimizer(params, torch.optim.AdamW)",
              "accelerate": "accelerate launch --use_deepspeed --zero_stage 1 --mixed_precision bf16 train.py",
              "lightning": "Trainer(strategy='deepspeed_stage_1', precision='bf16-mixed')",
              "trainer": "TrainingArguments(..., deepspeed={{'zero_optimization': {{'stage': 1}}, 'bf16': "
                         "{{'enabled': True}}}})"},
    "fsdp": {"torch": "fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) for each "
                      "block, then fully_shard(model)",
             "accelerate": "accelerate launch --use_fsdp --fsdp_version 2 --mixed_precision bf16 train.py",
             "lightning": "Trainer(strategy=FSDPStrategy(...), precision='bf16-mixed')",
             "trainer": "TrainingArguments(..., fsdp='full_shard auto_wrap', bf16=True)"},
}


def recipe(key: str, rank: int = 8) -> dict[str, str]:
    """Return ``{framework: code or flags}`` for strategy ``key``.

    >>> recipe("amp_bf16")["trainer"]
    'TrainingArguments(..., bf16=True)'
    """
    if key == "fp32":
        return {"torch": "model.float()  # no autocast", "accelerate": "Accelerator(mixed_precision='no')",
                "lightning": "Trainer(precision='32-true')", "trainer": "TrainingArguments(...)  # no fp16/bf16"}
    short = "fp16" if key in ("amp_fp16", "fp16_master") else "bf16"
    scaler = ("scaler = torch.amp.GradScaler('cuda')  # created once; scaler.scale(loss).backward() ... "
              "scaler.step(optimizer); scaler.update()\n" if short == "fp16" else "")
    amp = {f: t.format(dtype="float16" if short == "fp16" else "bfloat16", short=short, scaler=scaler)
           for f, t in _AMP.items()}
    if key in ("amp_fp16", "amp_bf16"):
        return amp
    stage = {"zero2": "2", "zero3": "3"}.get(key)
    if stage:
        return {f: t.replace("1", stage) if f != "torch" else
                "DeepSpeed: deepspeed.initialize(model=model, config={'zero_optimization': {'stage': %s}, 'bf16': "
                "{'enabled': True}})" % stage for f, t in recipe("zero1").items()}
    extra = _NOTES.get(key)
    if extra is None:
        raise ValueError(f"no recipe for strategy {key!r}")
    if key.startswith("amp_bf16_"):
        return {f: amp[f] + "\n" + extra[f] for f in FRAMEWORKS}
    return {f: t.format(rank=rank) for f, t in extra.items()}
