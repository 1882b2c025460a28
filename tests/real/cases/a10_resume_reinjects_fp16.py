# source: https://github.com/huggingface/diffusers/issues/6442
# also: https://github.com/huggingface/diffusers/issues/5004 , https://github.com/huggingface/diffusers/issues/6552
#   (failures.md row 4)
# reproduces: the script upcasts its LoRA params (cast_training_params), then --resume_from_checkpoint's load hook
#   re-injects LoRA into the fp16 model and loads the saved weights, which undoes the upcast: the error appears
#   only when resuming: ValueError: Attempting to unscale FP16 gradients.
# expect: AMP101
# fix: finishes
import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
from transformers import BertConfig, BertModel

torch.manual_seed(0)
cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
lora = LoraConfig(r=4, target_modules=["query", "value"])
model = BertModel(cfg).requires_grad_(False).to(torch.float16)  # frozen weights in weight_dtype
inject_adapter_in_model(lora, model)
for p in model.parameters():  # diffusers.training_utils.cast_training_params(model, torch.float32)
    if p.requires_grad:
        p.data = p.data.float()
torch.save(get_peft_model_state_dict(model), "checkpoint-lora.pt")  # what the interrupted run saved

# --resume_from_checkpoint: load_model_hook -> load_lora_into_unet() re-injects the adapters, then loads them
inject_adapter_in_model(lora, model)
set_peft_model_state_dict(model, torch.load("checkpoint-lora.pt"))

params = [p for p in model.parameters() if p.requires_grad]
opt, scaler = torch.optim.SGD(params, lr=1e-2), torch.amp.GradScaler("cpu")
ids, target = torch.randint(0, 100, (8, 12)), torch.zeros(8, 32)
for step in range(4):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(input_ids=ids).last_hidden_state[:, 0].float(), target)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss), f"non-finite loss at step {step}"
    print(f"step {step} loss {loss.item():.4f}")
