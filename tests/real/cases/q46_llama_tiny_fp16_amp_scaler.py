# source: https://github.com/huggingface/transformers/blob/main/examples/pytorch/language-modeling/run_clm_no_trainer.py
#   (model in fp32, accelerate mixed precision around the forward, loss = model(**batch).loss, AdamW)
# reproduces: nothing - a LlamaForCausalLM from a tiny LlamaConfig (fp32 parameters) trained on sequences of
#   320 tokens (rotary positions past 256) under fp16 autocast with GradScaler("cpu") (accelerate's
#   mixed_precision="fp16"), unscale_ before clipping, AdamW.
# expect: quiet
# ampdoctor-args: --audit-every
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
model = LlamaForCausalLM(cfg)
model.train()
no_decay = ["bias", "norm.weight"]
groups = [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
           "weight_decay": 0.01},
          {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
           "weight_decay": 0.0}]
opt = torch.optim.AdamW(groups, lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
input_ids = torch.randint(0, cfg.vocab_size, (2, 320))
batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}
for step in range(4):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch).loss
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss)
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")
