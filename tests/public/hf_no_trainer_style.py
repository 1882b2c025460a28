# Re-creates the mixed-precision structure of huggingface/transformers,
# examples/pytorch/text-classification/run_glue_no_trainer.py (commit a22a4378d97d). Written from scratch for
# ampdoctor's tests: an independent re-creation, no code copied.
# What it mirrors, in words: accelerate decides the precision (the mixed_precision that `accelerate launch` passes
# in ACCELERATE_MIXED_PRECISION); the sequence classifier comes from a checkpoint through from_pretrained (with
# --fp16-checkpoint one stored and loaded in float16, as many checkpoints on the hub are); torch AdamW with its
# default eps gets two parameter groups, weight decay for everything but biases and LayerNorm weights; model,
# optimizer, data loaders and a linear schedule go through accelerator.prepare; each step calls
# accelerator.backward(loss), optimizer.step, the scheduler and zero_grad; evaluation gathers predictions.
# The BERT is tiny and built from a BertConfig; the sentences are random token ids. Each batch's loss is printed.
import argparse
import os
import tempfile

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, get_scheduler


def fake_sentences(n, seed, length=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (n, length), generator=gen)
    labels = (ids[:, :3].sum(1) % 2).long()  # something learnable from the first tokens
    mask = torch.ones_like(ids)
    return [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)]


def build_classifier(stored_dtype, workdir):
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                     vocab_size=100, num_labels=2)
    fresh = BertForSequenceClassification(cfg)
    if stored_dtype is None:
        return fresh
    fresh.to(stored_dtype).save_pretrained(workdir)
    return BertForSequenceClassification.from_pretrained(workdir, dtype=stored_dtype)


def main():
    cli = argparse.ArgumentParser()
    cli.add_argument("--fp16-checkpoint", action="store_true", help="save the model in float16 and load it back")
    cli.add_argument("--epochs", type=int, default=2)
    cli.add_argument("--lr", type=float, default=1e-3)
    opts = cli.parse_args()

    accelerator = Accelerator(mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    with tempfile.TemporaryDirectory() as workdir:
        model = build_classifier(torch.float16 if opts.fp16_checkpoint else None, workdir)

    plain_names = ("bias", "LayerNorm.weight")
    decayed = [p for n, p in model.named_parameters() if not any(k in n for k in plain_names)]
    undecayed = [p for n, p in model.named_parameters() if any(k in n for k in plain_names)]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.01},
                                   {"params": undecayed, "weight_decay": 0.0}], lr=opts.lr)

    train_loader = DataLoader(fake_sentences(64, 0), batch_size=8, shuffle=True,
                              generator=torch.Generator().manual_seed(0))
    eval_loader = DataLoader(fake_sentences(16, 1), batch_size=8)
    schedule = get_scheduler("linear", optimizer, num_warmup_steps=0,
                             num_training_steps=opts.epochs * len(train_loader))
    model, optimizer, train_loader, eval_loader, schedule = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, schedule)

    for epoch in range(opts.epochs):
        model.train()
        for step, batch in enumerate(train_loader):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            accelerator.print(f"epoch {epoch} step {step}: loss {loss.item():.6f}")
        model.eval()
        right = total = 0
        for batch in eval_loader:
            with torch.no_grad():
                guess = model(**batch).logits.argmax(-1)
            guess, truth = accelerator.gather_for_metrics((guess, batch["labels"]))
            right += (guess == truth).sum().item()
            total += truth.numel()
        accelerator.print(f"epoch {epoch}: accuracy {right / total:.4f}")


if __name__ == "__main__":
    main()
