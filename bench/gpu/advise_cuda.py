"""advise's activation estimates against torch.cuda.max_memory_allocated for a transformer and a CNN."""
import torch
from torch import nn

import ampdoctor


def measured_peak(model, make_inputs, autocast):
    model = model.cuda()
    args = make_inputs()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model(*args)
        loss = (out.logits if hasattr(out, "logits") else out).float().pow(2).mean()
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

cfg = GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=8000, n_positions=1024)
cnn = lambda: nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),  # noqa: E731
                            nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
                            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
cases = [("gpt2-6x512 b8x512", lambda: GPT2LMHeadModel(cfg), 8, 512,
          lambda: (torch.randint(0, 8000, (8, 512), device="cuda"),)),
         ("cnn b32x64x64", cnn, 32, 64, lambda: (torch.randn(32, 3, 64, 64, device="cuda"),))]
for name, build, batch, seq, inputs in cases:
    torch.manual_seed(0)
    advice = ampdoctor.advise(build(), batch_size=batch, seq_len=seq)
    for key, autocast in (("fp32", False), ("amp_bf16", True)):
        row = advice.strategy(key)["bytes"]
        estimate = row["activations"] + row["gradients"]
        peak = measured_peak(build(), inputs, autocast)
        print(f"{name} {key}: estimate activations+gradients {estimate / 2**20:.1f} MiB, measured peak above the "
              f"weights {peak / 2**20:.1f} MiB, error {(estimate - peak) / peak:+.1%}")
