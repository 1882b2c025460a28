# Re-creates: pytorch/examples · distributed/FSDP/T5_training.py (+ utils/train_utils.py, policies/mixed_precision.py,
# policies/wrapping.py, configs/fsdp.py) · 77f55b912142 (folder last changed in 32fdb49). An independent
# re-creation written from scratch for ampdoctor's tests: no code, comments or structure are copied from the
# original.
#
# What it mirrors, in words: a T5 sequence-to-sequence model from transformers wrapped in FSDP1
# (`FullyShardedDataParallel`) with a transformer auto-wrap policy on `T5Block`, FULL_SHARD, and a MixedPrecision
# policy picked by the config: bf16 for parameters, reduction and buffers when the machine has bf16 support (the
# original's check needs CUDA and NCCL, so on CPU it is false), else, with `use_fp16`, **float16 for parameters,
# gradient reduction and buffers**, else none (fp32). The original's policy file notes that the fp16 policy needs
# a grad scaler in the main loop, and its training loop has none: `zero_grad`, the model called with input ids,
# attention mask and labels, `output["loss"].backward()`, `optimizer.step()`, the loss summed into a two-entry
# tensor that is all-reduced at the end of the epoch. AdamW and StepLR(step_size=1) stepped once per epoch. The
# process group from torchrun's variables. `--fp16` sets use_fp16. Tiny config, synthetic token data; rank 0 prints
# its loss at each step (the original shows a progress bar).
import argparse
import functools
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.optim.lr_scheduler import StepLR
from transformers import T5Config, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block

parser = argparse.ArgumentParser()
parser.add_argument("--fp16", action="store_true", help="the config's use_fp16")
parser.add_argument("--epochs", type=int, default=2)
opts = parser.parse_args()

warnings.filterwarnings("ignore", message=".*FSDP.*")  # FSDP1's deprecation notice, on every rank

HALF_EVERYWHERE = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)
BF16_EVERYWHERE = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                 buffer_dtype=torch.bfloat16)


def bf16_ready():
    return torch.version.cuda is not None and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def pick_policy():
    if bf16_ready() and not opts.fp16:
        return BF16_EVERYWHERE
    if opts.fp16:
        return HALF_EVERYWHERE
    return None


def batches(rank, count=12, size=4, source_len=24, target_len=8, vocab=128):
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(count):
        ids = torch.randint(2, vocab, (size, source_len), generator=gen)
        mask = torch.ones_like(ids)
        labels = ids[:, :target_len].flip(1).clone()  # a learnable toy target: the first tokens, reversed
        yield {"source_ids": ids, "source_mask": mask, "target_ids": labels}


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config)
    model = FullyShardedDataParallel(
        model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block}),
        mixed_precision=pick_policy(), sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"),
        limit_all_gathers=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.85)
    for epoch in range(1, opts.epochs + 1):
        model.train()
        totals = torch.zeros(2)
        for batch in batches(rank + 10 * epoch):
            optimizer.zero_grad()
            out = model(input_ids=batch["source_ids"], attention_mask=batch["source_mask"], labels=batch["target_ids"])
            loss = out["loss"]
            loss.backward()
            optimizer.step()
            totals[0] += loss.item()
            totals[1] += 1
            if rank == 0:
                print(f"epoch {epoch} step {int(totals[1])} loss {loss.item():.5f}", flush=True)
        dist.all_reduce(totals)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(totals[0] / totals[1]).item():.5f}", flush=True)
        scheduler.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
