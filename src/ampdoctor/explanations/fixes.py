"""Write the fix that fits what a finding saw, where the rule's own fix assumes another setup.

A rule's fix in the catalog is written for its commonest cause. Four findings need another one when what they
saw says otherwise: AMP601 (a module's output is inf/NaN) when the module's own weights were already non-finite, so
an optimizer step wrote them and no upcast of the forward helps; AMP603 (the loss scale keeps falling) and AMP613
(the loss is inf/NaN) when the forward's modules were seen finite, so there is no overflowing module to upcast; and
AMP608 (a non-finite
gradient norm) in a run with no enabled GradScaler, where ``scaler.unscale_(opt)`` is no advice. Dtypes are given
by name (``"float16"``), as the watch keeps them.

>>> print(nonfinite_grads_fix(False, ["bfloat16"], "bfloat16").splitlines()[0])
# no GradScaler (bf16 autocast needs none): skip the step yourself
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["UNKNOWN", "frozen_half_fix", "frozen_weights_fix", "minimum_scale_fix", "nonfinite_grads_fix",
           "nonfinite_loss_fix", "nonfinite_weights_fix", "scale_collapse_fix"]

UNKNOWN = "unknown"   # the autocast dtype of a run whose forward the caller did not see

_SKIP_STEP = ("norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
              "if torch.isfinite(norm):   # no step on inf/NaN gradients\n"
              "    opt.step()\n"
              "opt.zero_grad()")


def frozen_half_fix(model: str) -> str:
    """Return the fix for a module that overflows in a float16 model nothing trains (a teacher, a VAE): its weights
    are half, so it runs in float16 whatever autocast says; upcasting its compute means casting the model.

    >>> frozen_half_fix("vae.encoder").splitlines()[-2]
    'vae.encoder.to(torch.bfloat16)  # or torch.float32'
    """
    return ("# nothing trains this float16 model, and fp16 overflows above 65504:\n"
            "# run it in bfloat16 (fp32's range) or float32, feed it inputs of that\n"
            "# dtype and cast what it returns to the dtype you train in\n"
            f"{model}.to(torch.bfloat16)  # or torch.float32\n"
            "# or an fp16-safe checkpoint (SDXL's VAE: madebyollin/sdxl-vae-fp16-fix)")


def frozen_weights_fix() -> str:
    """Return the fix for a module whose output is inf/NaN because its weights are, while nothing trains them (a
    frozen teacher, a VAE): a checkpoint or a cast to float16 made them so.

    >>> frozen_weights_fix().splitlines()[0]
    '# its weights were inf/NaN already, and nothing trains them: a cast to'
    """
    return ("# its weights were inf/NaN already, and nothing trains them: a cast to\n"
            "# float16 (a weight above 65504 is inf) or the checkpoint made them so.\n"
            "# Load and run this model in bfloat16 or float32 instead:\n"
            "model = Model.from_pretrained(path, torch_dtype=torch.bfloat16)\n"
            "# or model.float()")


def nonfinite_weights_fix(weight_dtypes: Iterable[str]) -> str:
    """Return the fix for a module whose output is inf/NaN because an optimizer step left its weights so.

    fp16 weights point at AMP104's fix (Adam's eps=1e-8 is 0 in fp16) and fp32 master weights; any weights at a
    step taken on inf/NaN gradients (AMP608). The weights are lost: the run restarts from a finite checkpoint.

    >>> "eps=1e-4" in nonfinite_weights_fix(["float16"]), "eps=1e-4" in nonfinite_weights_fix(["float32"])
    (True, False)
    """
    dtypes = set(weight_dtypes)
    lines = ["# its weights were inf/NaN already: an optimizer step (or a checkpoint)",
             "# wrote them; no overflow, so upcasting the module does not help. Fix the",
             "# step, then restart from a checkpoint whose weights are finite:"]
    if "float16" in dtypes:   # fp16's smallest subnormal is 2**-24 ≈ 6e-8: eps=1e-8 rounds to 0
        lines += ["# Adam/AdamW eps=1e-8 is 0 in fp16 (AMP104): a zero gradient gives 0/0",
                  "opt = torch.optim.AdamW(params, eps=1e-4)  # or fused=True: eps in fp32",
                  "# better: keep fp32 master weights: opt = ampdoctor.MasterWeights(opt)"]
    lines += ["# a step on inf/NaN gradients (AMP608) writes NaN too: skip such steps", _SKIP_STEP]
    return "\n".join(lines)


def nonfinite_grads_fix(scaler_enabled: bool, param_dtypes: Iterable[str], autocast: str | None = UNKNOWN
                        ) -> str | None:
    """Return the fix for inf/NaN gradients that fits the run, or None where the rule's own (an enabled
    GradScaler: unscale_, clip, step, update) does.

    Args:
        scaler_enabled: whether an enabled GradScaler scales the loss.
        param_dtypes: the dtypes of the trainable parameters.
        autocast: the forward's autocast dtype (``"float16"``, ``"bfloat16"``), None for none, `UNKNOWN` when the
            caller did not see the forward.

    >>> nonfinite_grads_fix(True, ["float32"], "float16") is None
    True
    >>> "GradScaler" in nonfinite_grads_fix(False, ["float32"], "float16")
    True
    """
    if scaler_enabled:
        return None
    dtypes = set(param_dtypes)
    if "float16" in dtypes:   # a GradScaler refuses fp16 gradients: "Attempting to unscale FP16 gradients"
        return ("# no GradScaler skips a step on inf/NaN gradients, and with fp16 parameters\n"
                "# none can (it refuses fp16 gradients): keep fp32 master weights, then scale\n"
                "opt = ampdoctor.MasterWeights(opt)\n"
                "scaler = torch.amp.GradScaler(device)   # skips steps on inf/NaN gradients\n"
                "scaler.scale(loss).backward()\n"
                "scaler.step(opt); scaler.update()")
    if autocast == "float16":
        return ("# fp16 autocast with no GradScaler (AMP208): add one; it scales the loss and\n"
                "# skips the steps whose gradients are inf/NaN\n"
                "scaler = torch.amp.GradScaler(device)\n"
                "scaler.scale(loss).backward()\n"
                "scaler.unscale_(opt)\n"
                "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
                "scaler.step(opt); scaler.update()")
    why = {"bfloat16": "bf16 autocast needs none", None: "no autocast"}.get(autocast, "")
    head = f"# no GradScaler{f' ({why})' if why else ''}: skip the step yourself"
    tail = ("\n# under fp16 autocast, add torch.amp.GradScaler(device) instead (AMP208)"
            if autocast == UNKNOWN else "")
    return (f"{head}\n{_SKIP_STEP}\n# find where they start: ampdoctor run --activations{tail}")


def scale_collapse_fix(origin: str | None, any_scale: bool = False) -> str | None:
    """Return the fix for a collapsing loss scale whose skipped steps had a finite forward, or None where the
    rule's own (upcast the module that overflows, AMP601) fits: ``origin`` is ``ScaleMonitor.origin()``;
    ``any_scale``: the gradients stayed inf/NaN down to a scale where nothing the scale multiplies can overflow
    (``ScaleMonitor.beyond_overflow``), so a wider format is not the first thing to try.

    >>> scale_collapse_fix("forward") is None, scale_collapse_fix(None) is None
    (True, True)
    >>> print(scale_collapse_fix("backward").splitlines()[0])
    # every module output and the loss were finite: the backward makes the
    >>> "bfloat16" in scale_collapse_fix("backward", any_scale=True).splitlines()[0]
    False
    """
    if origin == "loss":
        return nonfinite_loss_fix()
    if origin == "backward" and any_scale:
        return "\n".join([
            "# the gradients are inf/NaN at any loss scale: find the op first; AMP602",
            "# names the first module whose output gradient is inf/NaN",
            "ampdoctor.watch(model, opt, scaler, activations=True)",
            "# an op that is inf/NaN in any dtype at 0 (sqrt, log, x / 0): keep it off 0",
            "y = torch.sqrt(x + 1e-12)          # d/dx sqrt(x) is inf at x = 0",
            "# an fp16 op that overflows on values the scale does not carry (x**2 in a",
            "# norm): run it in fp32, or train in bf16 (fp32's range)"])
    if origin in ("backward", "outputs"):
        head = ["# every module output and the loss were finite: the backward makes the",
                "# inf/NaN. Where it overflows fp16, train in bf16 (fp32's range):"] if origin == "backward" else \
            ["# every module output was finite: the inf/NaN start in the loss or the",
             "# backward. Compute the loss in fp32, and train in bf16 (fp32's range):"]
        return "\n".join([*head, "with torch.autocast(device_type, dtype=torch.bfloat16): ...",
                          "# or find the op and run it in fp32; AMP602 names the first module whose",
                          "# output gradient is inf/NaN:",
                          "ampdoctor.watch(model, opt, scaler, activations=True)"])
    return None


def minimum_scale_fix(family: str) -> str | None:
    """Return the fix for a library's loss scaler that stopped the run at its minimum scale (AMP603 on a crash), in
    that library's settings: ``"fairseq"`` or ``"DeepSpeed"``; None for another (the rule's own fix).

    >>> minimum_scale_fix("fairseq").splitlines()[0]
    '# fairseq stops at --min-loss-scale: a lower one only postpones the stop'
    """
    if family == "fairseq":
        return "\n".join([
            "# fairseq stops at --min-loss-scale: a lower one only postpones the stop",
            "# a loss that explodes (a learning rate too high) overflows at any scale:",
            "#   a lower --lr, --warmup-updates, --clip-norm 1.0",
            "# an op that overflows fp16 in the forward: --bf16 instead of --fp16; the",
            "#   log after the crash names the first module with inf/NaN (\"NaN detected",
            "#   in output of ...\"): keep that module in fp32",
            "# occasional spikes only: --fp16-scale-tolerance 0.25 (the scale falls once",
            "#   25% of the steps since its last change overflowed)"])
    if family == "DeepSpeed":
        return "\n".join([
            "# DeepSpeed raises at \"fp16\": {\"min_loss_scale\": 1}: a lower one only",
            "# postpones it",
            "# a loss that explodes (a learning rate too high) overflows at any scale:",
            "#   lower the learning rate, warm it up, \"gradient_clipping\": 1.0",
            "# an op that overflows fp16 in the forward: train in bf16",
            "{\"bf16\": {\"enabled\": True}}   # in the config, instead of \"fp16\""])
    return None


def nonfinite_loss_fix() -> str:
    """Return the fix for a loss that is inf/NaN while every module output of the model was finite: the loss's own
    computation makes it (AMP613, and AMP603 when such steps are skipped), so no module is to upcast.

    >>> nonfinite_loss_fix().splitlines()[0]
    '# every module output was finite and the loss was not: compute it in fp32,'
    """
    return ("# every module output was finite and the loss was not: compute it in fp32,\n"
            "# from logits, in a stable form (no log of 0, no division by 0)\n"
            "loss = F.binary_cross_entropy_with_logits(logits.float(), y)\n"
            "# or F.cross_entropy(logits.float(), y); log_softmax, not log(softmax)\n"
            "# and check what else it reads: a frozen teacher's or encoder's fp16 output\n"
            "# can overflow to inf (run that model in fp32 or bf16)")
