# source: https://github.com/huggingface/transformers/issues/14189
# also: https://github.com/huggingface/transformers/issues/5651 (failures.md row 25)
# reproduces: a T5 (tiny config, no download) whose FFN (`wi`, `wo`) carries the large weights of a
#   bf16-pretrained checkpoint, fine-tuned with fp16 autocast: `wo` outputs exceed 65504 -> inf -> loss = nan at
#   every step while the GradScaler keeps halving the scale. The rule should name the module.
# expect: AMP601 AMP603
# expect-detail: AMP601 DenseReluDense\.wo\b
import sys

import torch
from transformers import T5Config, T5ForConditionalGeneration

torch.manual_seed(0)
cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
               decoder_start_token_id=0, pad_token_id=0)
model = T5ForConditionalGeneration(cfg)
with torch.no_grad():  # activations of a bf16-pretrained T5 reach 66246 in T5DenseActDense.wo
    ffn = model.encoder.block[0].layer[1].DenseReluDense
    ffn.wi.weight.mul_(100.0)
    ffn.wo.weight.mul_(1000.0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cpu")
ids, labels = torch.randint(0, 64, (4, 12)), torch.randint(0, 64, (4, 6))
for step in range(12):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=labels).loss
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")
if not torch.isfinite(loss):
    sys.exit(f"SYMPTOM: loss = {loss.item()} at every step; loss scale fell to {scaler.get_scale():g}")
