# Re-creates the mixed-precision structure of facebookresearch/mae: engine_pretrain.py, util/misc.py
# (NativeScalerWithGradNormCount), util/lr_sched.py and main_pretrain.py, at commit efb2a80 (those files unchanged
# since be47fef). Written from scratch for ampdoctor's tests: an independent re-creation, no code copied.
# What it mirrors, in words: the GradScaler lives inside a small callable wrapper object that the loop calls with
# the loss; the wrapper runs scale(loss).backward() on every micro-batch and, only on the last micro-batch of an
# accumulation window, unscales, measures the gradient norm (clip_grad_norm_ when a clip value is given, else a
# stack of per-parameter norms), then steps and updates the scaler. The loop sets the learning rate of every group
# per iteration (linear warm-up, then a half-cycle cosine), runs the forward under autocast, reads loss.item() and
# stops the process with exit status 1 when that loss is not finite, divides the loss by the window length, and
# zeroes the gradients after each window. AdamW with betas (0.9, 0.95) over two groups: weight decay for matrices,
# none for biases and norms. The model is a tiny masked autoencoder (a conv patch embedding, random masking of 75%
# of the patches, pre-norm transformer blocks, a narrower decoder, a pixel loss on the masked patches only).
# The original calls the CUDA autocast and scaler; here the device type is a parameter so that it runs on CPU.
# Usage: python mae_style.py [--steps N] [--accum K] [--half] [--uint16-pixels]
#   --half           casts the whole model to float16 before the optimizer is built (a stray .half())
#   --uint16-pixels  feeds raw 16-bit sensor values (0..65535) instead of normalized images
import argparse
import math
import sys

import torch
import torch.nn as nn

IMAGE, PATCH, WIDTH, DEC_WIDTH, HEADS = 16, 4, 32, 16, 2
PATCHES = (IMAGE // PATCH) ** 2


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyMAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, WIDTH, PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, WIDTH))
        self.pos_embed = nn.Parameter(torch.randn(1, PATCHES + 1, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.decoder_embed = nn.Linear(WIDTH, DEC_WIDTH)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, DEC_WIDTH))
        self.decoder_pos_embed = nn.Parameter(torch.randn(1, PATCHES + 1, DEC_WIDTH) * 0.02)
        self.decoder_blocks = nn.ModuleList([Block(DEC_WIDTH)])
        self.decoder_norm = nn.LayerNorm(DEC_WIDTH)
        self.decoder_pred = nn.Linear(DEC_WIDTH, PATCH * PATCH * 3)

    @staticmethod
    def patches(images):
        n = images.shape[0]
        grid = images.reshape(n, 3, IMAGE // PATCH, PATCH, IMAGE // PATCH, PATCH)
        return grid.permute(0, 2, 4, 3, 5, 1).reshape(n, PATCHES, PATCH * PATCH * 3)

    def forward(self, images, mask_ratio=0.75):
        n = images.shape[0]
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed[:, 1:]
        keep = int(PATCHES * (1 - mask_ratio))
        order = torch.rand(n, PATCHES, device=images.device).argsort(1)
        restore = order.argsort(1)
        kept = order[:, :keep]
        x = x.gather(1, kept[..., None].expand(-1, -1, WIDTH))
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(n, -1, -1)
        x = torch.cat([cls, x], 1)
        for block in self.blocks:
            x = block(x)
        x = self.decoder_embed(self.norm(x))
        filler = self.mask_token.expand(n, PATCHES - keep, -1).to(x.dtype)
        body = torch.cat([x[:, 1:], filler], 1).gather(1, restore[..., None].expand(-1, -1, DEC_WIDTH))
        x = torch.cat([x[:, :1], body], 1) + self.decoder_pos_embed
        for block in self.decoder_blocks:
            x = block(x)
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:]
        hidden = torch.ones(n, PATCHES, device=images.device)
        hidden[:, :keep] = 0
        hidden = hidden.gather(1, restore)
        error = ((pred - self.patches(images)) ** 2).mean(-1)
        return (error * hidden).sum() / hidden.sum()


class ScalerWrapper:
    """Holds the GradScaler; called once per micro-batch with the (already divided) loss."""

    def __init__(self, device_type):
        self._scaler = torch.amp.GradScaler(device_type)

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, update_grad=True):
        self._scaler.scale(loss).backward()
        if not update_grad:
            return None
        self._scaler.unscale_(optimizer)
        if clip_grad is not None:
            norm = torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        else:
            grads = [p.grad for p in parameters if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        self._scaler.step(optimizer)
        self._scaler.update()
        return norm


def set_lr(optimizer, progress, opts):
    if progress < opts.warmup:
        lr = opts.lr * progress / opts.warmup
    else:
        lr = opts.lr * 0.5 * (1.0 + math.cos(math.pi * (progress - opts.warmup) / (opts.epochs - opts.warmup)))
    for group in optimizer.param_groups:
        group["lr"] = lr


def main():
    cli = argparse.ArgumentParser()
    cli.add_argument("--device", default="cpu")
    cli.add_argument("--epochs", type=int, default=2)
    cli.add_argument("--steps", type=int, default=8, help="micro-batches per epoch")
    cli.add_argument("--accum", type=int, default=2)
    cli.add_argument("--lr", type=float, default=1.5e-3)
    cli.add_argument("--warmup", type=float, default=1.0)
    cli.add_argument("--clip", type=float, default=None)
    cli.add_argument("--half", action="store_true")
    cli.add_argument("--uint16-pixels", action="store_true")
    opts = cli.parse_args()

    torch.manual_seed(0)
    device = torch.device(opts.device)
    model = TinyMAE().to(device)
    if opts.half:
        model = model.half()
    decay = [p for name, p in model.named_parameters() if p.ndim > 1 and not name.endswith("_token")]
    no_decay = [p for name, p in model.named_parameters() if p.ndim <= 1 or name.endswith("_token")]
    optimizer = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0},
                                   {"params": decay, "weight_decay": 0.05}], lr=opts.lr, betas=(0.9, 0.95))
    loss_scaler = ScalerWrapper(device.type)

    gen = torch.Generator().manual_seed(0)
    images = torch.rand(opts.steps, 4, 3, IMAGE, IMAGE, generator=gen)
    if opts.uint16_pixels:
        images = (images * 65535).round()
    else:
        images = (images - 0.45) / 0.225

    for epoch in range(opts.epochs):
        model.train(True)
        optimizer.zero_grad()
        for i in range(opts.steps):
            if i % opts.accum == 0:
                set_lr(optimizer, i / opts.steps + epoch, opts)
            samples = images[i].to(device, non_blocking=True)
            if opts.half:
                samples = samples.half()
            with torch.autocast(device_type=device.type, dtype=torch.float16):
                loss = model(samples)
            value = loss.item()
            if not math.isfinite(value):
                print(f"Loss is {value}, stopping training")
                sys.exit(1)
            loss = loss / opts.accum
            last = (i + 1) % opts.accum == 0
            loss_scaler(loss, optimizer, clip_grad=opts.clip, parameters=model.parameters(), update_grad=last)
            if last:
                optimizer.zero_grad()
            print(f"epoch {epoch} step {i} loss {value:.6f}")


if __name__ == "__main__":
    main()
