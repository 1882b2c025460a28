import sys

import torch

model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(3, 2)).sum().backward()
opt.step()
sys.exit(int(sys.argv[1]))
