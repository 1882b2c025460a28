"""accelerate with its DeepSpeed plugin on the CPU, as accelerate's DeepSpeed examples drive it: ``Accelerator(
mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))``, ``prepare``, ``accelerator.backward``.

``prepare`` returns a ``DeepSpeedOptimizerWrapper`` around DeepSpeed's ``DeepSpeedZeroOptimizer`` (no torch
optimizer) around the script's torch AdamW. Run with ``ACCELERATE_USE_DEEPSPEED=true DS_ACCELERATOR=cpu``.
"""

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from torch import nn

accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 16), torch.randint(0, 4, (24,))),
                                   batch_size=4)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for step, (x, y) in enumerate(data):
    loss = nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.print(f"step {step} loss {loss.item():.6f}")
