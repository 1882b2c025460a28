"""Tiny real models shared by the advise tests."""

from __future__ import annotations

import json

import torch
from torch import nn

TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
                  max_position_embeddings=64, rms_norm_eps=1e-5)


def write_config(folder, config=TINY_LLAMA):
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def real_llama(config=TINY_LLAMA):
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).train()


class SmallCNN(nn.Module):
    """Conv blocks (the repeated unit) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(16) for _ in range(3)])
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(x.mean((2, 3)))


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(torch.relu(self.bn(self.conv1(x))))


def small_transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True)
    return nn.Sequential(nn.Embedding(100, 64), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                         nn.Linear(64, 100))


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def state_bytes(optimizer):
    return nbytes(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
