"""The model has an auxiliary head whose loss term was dropped from the training step: the head's parameters are
trainable and given to the optimizer, but the loss never reaches them, so they never get a gradient."""
import torch
from torch import nn


class WithAuxHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.aux_head = nn.Linear(16, 32), nn.Linear(32, 1), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head(h), self.aux_head(h)


torch.manual_seed(0)
model = WithAuxHead()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(5):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, aux = model(x)
        loss = nn.functional.mse_loss(out.float(), y)  # the aux term, + 0.1 * aux_loss(aux), was dropped
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"loss {loss.item():.4f}")
