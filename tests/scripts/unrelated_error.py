"""A script that fails for a reason that has nothing to do with mixed precision."""
import torch

model = torch.nn.Linear(4, 4)
config = {"lr": 0.1}
print("starting")
lr = config["learning_rate"]
