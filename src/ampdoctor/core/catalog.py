'''The catalog of mixed-precision rules: stable codes, explanations and fixes.

Every rule, whether it runs before the first step (``preflight``), while the GradScaler state machine runs
(``runtime``), on a crash (``crash``) or while watching numerics (``watch``), lives here. Crash explanations match
the ``errors`` patterns of these same rules, so there is one source of truth. Codes are never reused.
'''

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Iterable

from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.formats import BF16, FP16, lost_below

# A rule's phase: what checks it and when (the rule pages and ``ampdoctor rules`` name it)
CHECKED_BY = {
    "preflight": "the pre-flight check, at the first optimizer step (or ampdoctor.check())",
    "runtime": "the GradScaler guard, as scale, unscale_, step and update are called",
    "crash": "the crash explanation, when training raises",
    "watch": "the numerics watch, while training runs",
}
PHASES = tuple(CHECKED_BY)


@dataclass(frozen=True)
class Rule:
    """One catalog entry.

    Attributes:
        code: stable identifier such as ``"AMP101"``; prefixes group rules (``AMP1`` = parameter dtypes).
        name: symbolic kebab-case name.
        title: one line saying what is wrong.
        why: why it hurts.
        fix: the fix, as code the user can paste.
        severity: default severity of its findings.
        phase: when it is checked; one of ``PHASES``.
        errors: regular expressions matching the torch or library error texts this rule explains.
        cases: the public reports it comes from, by number (``docs/_ext/reports.py`` links each to its threads).
        escalates: the other severities its findings take, each with when: one place says every severity a rule
            can have, so that ``ampdoctor rules``, ``explain``, the rule pages and a run agree.
    """

    code: str
    name: str
    title: str
    why: str
    fix: str
    severity: Severity
    phase: str
    errors: tuple[str, ...] = ()
    cases: tuple[int, ...] = ()
    escalates: tuple[tuple[Severity, str], ...] = ()
    _compiled: tuple[re.Pattern[str], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", tuple(re.compile(p, re.IGNORECASE) for p in self.errors))

    def matches(self, text: str) -> bool:
        """Return whether ``text`` contains one of the error texts this rule explains."""
        return any(p.search(text) for p in self._compiled)

    def finding(self, where: str, detail: str, step: int | None = None, *, severity: Severity | None = None,
                cause: str | None = None, fix: str | None = None) -> Finding:
        """Return a finding of this rule at ``where``: with the rule's severity unless the check escalates it, and
        the rule's fix unless ``fix`` gives the one that fits what was seen.

        >>> get_rule("AMP101").finding("head", "head.weight is trainable float16").severity.value
        'error'
        """
        severity = severity or self.severity
        if severity not in self.severities:
            raise ValueError(f"{self.code} findings are {' or '.join(s.value for s in self.severities)} in the "
                             f"catalog, not {severity.value}: declare when in its Rule(escalates=...)")
        return Finding(self.code, severity, where, detail, step, cause=cause, fix=None if fix == self.fix else fix)

    @property
    def severities(self) -> tuple[Severity, ...]:
        """Every severity this rule's findings can have: its own first."""
        return (self.severity, *(s for s, _ in self.escalates))

    def severity_text(self) -> str:
        """Return the rule's severity as the catalog states it, with when its findings take another.

        >>> get_rule("AMP612").severity_text()
        'warning; error when no optimizer step updated a weight, or most backward calls went to no step'
        """
        return "; ".join([self.severity.value, *(f"{s.value} when {when}" for s, when in self.escalates)])


ERROR, WARNING, INFO = Severity.ERROR, Severity.WARNING, Severity.INFO

# How a fix says "let ampdoctor repair it"; a run says it as it was started (`with_fix_command`)
FIX_COMMAND = "ampdoctor run --fix train.py"

_UNSCALE_TWICE = r"unscale_\(\) has already been called on this optimizer since the last update\(\)"
_HALF_FLOAT = (
    r"expected scalar type (Half|BFloat16|Float) but found (Half|BFloat16|Float)",
    r"Input type \(\S+\) and (bias|weight) type \(\S+\) should be the same",
    r"mat1 and mat2 must have the same dtype",
    r"expected mat1 and mat2 to have the same dtype",
    r"expected m1 and m2 to have the same dtype",
    r"self and mat2 must have the same dtype",
    r"expected (both vectors|query, key|input|key|value)[^\n]*same dtype",
    r"mixed dtype \(CPU\): expect parameter to have scalar type of Float",
    r"expected [^\n]{0,200}?dtype[^\n]{0,200}? to match",
    r"Input dtypes must be the same, got: input \w+, batch1",
    r"RNN input dtype \(torch\.\w+\) does not match weight dtype",
    r"Type promoting not supported\. Got \w+ and \w+",
    r"expected self and source to have same dtypes",
    r"self \(\w+\) and source \(\w+\) must have the same scalar type",
    r"Index put requires the source and destination dtypes match",
    r"Expected self\.dtype to be equal to src\.dtype",
    r"Expected tensor for argument #\d+ '\w+' to have the same type as tensor for argument",
    r"Found dtype (Half|BFloat16|Float) but expected (Half|BFloat16|Float)",
)

RULES: tuple[Rule, ...] = (
    # ---- AMP0xx: ampdoctor itself ---------------------------------------------------------------------------
    Rule(
        "AMP001", "internal-error", "ampdoctor hit an internal error and stepped aside",
        "A check, monitor or writer of ampdoctor raised. Your training was not affected; that part of ampdoctor "
        "is switched off for the rest of the run.",
        "# please report it with `ampdoctor env` output: https://github.com/ampdoctor/ampdoctor/issues",
        Severity.INFO, "runtime", (), (),
    ),
    # ---- AMP1xx: trainable parameter dtypes -------------------------------------------------------------
    Rule(
        "AMP101", "fp16-trainable-params", "Trainable float16 parameters under an fp16 GradScaler",
        "GradScaler unscales gradients in the parameter dtype. It refuses float16 gradients because an fp16 "
        "optimizer update loses small steps (fp16 keeps 11 significant bits), so the first unscale_() raises "
        "without naming the parameter. AMP expects fp32 parameters with fp16 compute under torch.autocast.",
        "ampdoctor.upcast_trainable_params_(model)\n"
        f"# or run it as: {FIX_COMMAND}\n"
        "# by hand: for p in model.parameters():\n"
        "#     if p.requires_grad: p.data = p.data.float()\n"
        "# peft: get_peft_model(model, config, autocast_adapter_dtype=True)\n"
        "#   (LoRA adapters only; modules_to_save copies stay half: upcast them)\n"
        "# diffusers: cast_training_params(model, dtype=torch.float32)",
        ERROR, "preflight", (r"Attempting to unscale FP16 gradients",), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11),
    ),
    Rule(
        "AMP102", "bf16-params-fp16-amp", "Trainable bfloat16 parameters under an fp16 GradScaler or fp16 autocast",
        "bf16 and fp16 have different ranges. On torch versions whose CUDA unscale kernel has no bfloat16 "
        "version, scaler.step raises on GPU; on CPU it runs but mixes two half formats and still updates in bf16.",
        "ampdoctor.upcast_trainable_params_(model)   # keep trainable params fp32, fp16 autocast + GradScaler\n"
        "# or on Ampere+: drop the GradScaler and use torch.autocast(device, dtype=torch.bfloat16)",
        ERROR, "preflight",
        (r"_amp_(foreach_)?non_finite_check_and_unscale_\w*\"? not implemented for 'BFloat16'",),
        (12, 13),
    ),
    Rule(
        "AMP103", "pure-half-no-master", "Pure half-precision training without fp32 master weights",
        "The optimizer updates fp16/bf16 weights directly. w + lr*g rounds back to w when |lr*g| is below half an "
        f"ulp of w: always below {lost_below(FP16)} (fp16) or {lost_below(BF16)} (bf16), and up to twice that "
        "depending on w, so small updates vanish silently: LoRAs that learn nothing, frozen LayerNorm gains.",
        "opt = ampdoctor.MasterWeights(opt)   # fp32 master copy, model stays half\n"
        "# or keep parameters fp32 and run the forward under torch.autocast(...)",
        WARNING, "preflight", (), (14, 15, 16, 39),
    ),
    Rule(
        "AMP104", "adam-eps-underflow", "Adam eps is below what the parameter or state dtype can represent",
        "Adam divides by sqrt(v) + eps. fp16's smallest subnormal is 2**-24 ≈ 6e-8, so eps=1e-8 becomes 0 and "
        "entries with zero gradient give 0/0 = NaN.",
        "opt = torch.optim.AdamW(params, eps=1e-4)  # or fused=True: eps in fp32\n"
        "# better: keep fp32 master weights: opt = ampdoctor.MasterWeights(opt)",
        ERROR, "preflight", (), (16,),
    ),
    Rule(
        "AMP105", "fused-optimizer-fp16-params",
        "A fused optimizer over float16 parameters hides the fp16-unscale error",
        "Fused optimizers unscale inside their kernel (GradScaler passes allow_fp16=True), so no error is raised "
        "and training is silently pure fp16, losing small updates. The first explicit unscale_() (for "
        "clipping) then raises 'Attempting to unscale FP16 gradients'.",
        "ampdoctor.upcast_trainable_params_(model, optimizer=opt)",
        WARNING, "preflight", (), (1,),
    ),
    # ---- AMP2xx: scaler, autocast and accelerator configuration --------------------------------------------
    Rule(
        "AMP201", "scaler-with-bf16", "A GradScaler is used with bf16 autocast",
        "bf16 has fp32's exponent range, so loss scaling is not needed; the scaler only costs time (and on CUDA "
        "bf16 gradients make it raise).",
        "scaler = torch.amp.GradScaler(device, enabled=False)   # or remove scaler.scale/step/update",
        WARNING, "preflight", (), (40,),
    ),
    Rule(
        "AMP202", "cuda-scaler-disabled", "GradScaler('cuda') quietly disabled itself: CUDA is not available",
        "torch disables a 'cuda' GradScaler with one UserWarning when CUDA is missing. Training then runs with no "
        "loss scaling, and fp16 gradients can underflow to zero unnoticed.",
        "scaler = torch.amp.GradScaler('cpu')   # match the device you train on",
        WARNING, "preflight", (r"GradScaler is enabled, but CUDA is not available", ), (37,),
    ),
    Rule(
        "AMP203", "accelerate-fp16-ignored", "accelerate's mixed_precision='fp16' is not in effect",
        "Accelerator(mixed_precision='fp16') on a CPU (also the one a transformers Trainer builds for fp16=True) "
        "keeps reporting 'fp16' but creates no GradScaler and no autocast: each layer silently computes in its own "
        "parameters' dtype (fp32 for an fp32 model) with no loss scaling, so what you test is not what you will run "
        "on GPU.",
        "accelerator = Accelerator(mixed_precision='bf16')   # on CPU; keep 'fp16' for CUDA runs\n"
        "# transformers Trainer: TrainingArguments(..., bf16=True)   # fp16=True on CUDA",
        WARNING, "preflight", (r"fp16 mixed precision requires a GPU",), (7,),
    ),
    Rule(
        "AMP204", "closure-with-scaler", "An optimizer closure (LBFGS) is used with an enabled GradScaler",
        "GradScaler.step cannot re-evaluate a closure under loss scaling and raises.",
        "# LBFGS: train without GradScaler (fp32 or bf16 autocast), or use a first-order optimizer with AMP",
        ERROR, "preflight", (r"Closure use is not currently supported if GradScaler is enabled",), (),
    ),
    Rule(
        "AMP205", "fsdp-fp16-plain-scaler", "Sharded FSDP training with fp16 parameters uses a non-sharded GradScaler",
        "A plain GradScaler refuses fp16 gradients and makes rank-local skip decisions: ranks disagree and "
        "collectives hang. ShardedGradScaler allows fp16 and all-reduces found_inf.",
        "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\nscaler = ShardedGradScaler()",
        ERROR, "preflight", (), (33, 34),
    ),
    Rule(
        "AMP206", "scaler-kernel-unsupported", "The GradScaler kernels do not support this device or layout",
        "Old torch versions lacked CPU and sparse kernels for the unscale and inf-check ops.",
        "# pip install 'torch>=2.4', then:\n"
        "scaler = torch.amp.GradScaler('cpu')   # on CPU prefer bf16 autocast, no scaler",
        ERROR, "crash",
        (r"Could not run 'aten::_amp_(foreach_)?non_finite_check_and_unscale_' with arguments from the",),
        (34, 37, 38),
    ),
    Rule(
        "AMP207", "bad-scaler-config", "GradScaler was constructed or updated with invalid values",
        "growth_factor must be > 1, backoff_factor < 1, and a manual new_scale must be a float or a 1-element "
        "tensor.",
        "scaler = torch.amp.GradScaler(device, growth_factor=2.0, backoff_factor=0.5)\n"
        "scaler.update(new_scale=float(value))",
        ERROR, "crash",
        (r"The growth factor must be > 1\.0", r"The backoff factor must be < 1\.0",
         r"new_scale should be a float or a 1-element"),
        (),
    ),
    Rule(
        "AMP208", "fp16-autocast-no-scaler",
        "fp16 autocast (or FSDP fp16 compute) runs without a GradScaler",
        "Under fp16 autocast, or FSDP's param_dtype=torch.float16, the backward runs in fp16 too. Without loss "
        "scaling every gradient below fp16's smallest subnormal, 2**-24 ≈ 6e-8, becomes 0 and those below "
        "2**-14 ≈ 6.1e-5 lose precision: small "
        "updates vanish silently. A GradScaler multiplies the loss so they survive; bf16 has fp32's range and needs "
        "none.",
        "scaler = torch.amp.GradScaler(device_type)\n"
        "with torch.autocast(device_type, dtype=torch.float16):\n    loss = model(x)\n"
        "scaler.scale(loss).backward(); scaler.step(opt); scaler.update()\n"
        "# or: torch.autocast(device_type, dtype=torch.bfloat16) and no scaler\n"
        "# FSDP with param_dtype=torch.float16: the same steps with ShardedGradScaler(device_type)",
        WARNING, "preflight", (), (33,),
        escalates=((ERROR, "the watch measured every sampled gradient entry exactly 0: nothing trains"),),
    ),
    Rule(
        "AMP209", "trainer-flag-half-model",
        "The Trainer's fp16/bf16 flag is set on a model loaded in half precision",
        "fp16=True/bf16=True ask accelerate for fp32 weights with fp16/bf16 autocast. A model loaded with "
        "dtype=torch.float16 (or .half()) has half weights instead: a GradScaler refuses their fp16 gradients, and a "
        "plain optimizer updates them in half precision, where small updates round away.",
        "model = AutoModel.from_pretrained(name)            # fp32 weights; fp16=True/bf16=True autocasts\n"
        "# or: ampdoctor.fix(model) before Trainer(...); or AmpDoctorCallback(fix=True)\n"
        "# peft: get_peft_model(model, config, autocast_adapter_dtype=True)",
        WARNING, "preflight",
    ),
    Rule(
        "AMP210", "fsdp-low-precision-reduce", "FSDP reduces gradients across ranks in fp16 or bf16",
        "FSDP sums the gradients of N ranks in reduce_dtype, which defaults to param_dtype. In fp16 it divides by "
        "about sqrt(N) before and after the sum to stay in range, so a gradient above 65504/sqrt(N) overflows to "
        "inf (a skipped step) and one below 2**-24·sqrt(N) flushes to 0; both grow with N. In bf16 every partial "
        "sum rounds to 8 significant bits, so small contributions of other ranks are lost.",
        "from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy\n"
        "FSDP(model, mixed_precision=MixedPrecision(\n"
        "    param_dtype=torch.float16, reduce_dtype=torch.float32))\n"
        "fully_shard(model, mp_policy=MixedPrecisionPolicy(\n"
        "    param_dtype=torch.bfloat16, reduce_dtype=torch.float32))",
        WARNING, "preflight", (), (),
        escalates=((INFO, "the reduction is in bf16, whose range does not overflow"),),
    ),
    Rule(
        "AMP211", "rank-local-skip", "Ranks decide alone whether to skip a step: sharded gradients, non-sharded scaler",
        "FSDP (FSDP1) gives each rank one shard of every gradient. A plain GradScaler checks only the local shard for "
        "inf/NaN, so one rank skips the step while the others apply it, and their loss scales drift apart; the next "
        "reduce-scatter then sums gradients multiplied by different scales. ShardedGradScaler all-reduces found_inf "
        "so every rank takes the same decision (FSDP2's DTensor gradients do this for a plain GradScaler).",
        "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\nscaler = ShardedGradScaler()",
        ERROR, "preflight", (), (),
    ),
    Rule(
        "AMP212", "engine-owns-precision", "DeepSpeed, Megatron-LM or apex owns mixed precision: not checked inside",
        "These engines keep their own fp32 master copies (flat partitions) and, for fp16, their own loss scaler "
        "and overflow check, all-reduced across ranks. ampdoctor's parameter, optimizer and GradScaler rules "
        "(AMP1xx-AMP3xx) would read those fp32 copies as tensors outside the model, so they leave the engine's "
        "objects alone, and --fix neither upcasts nor wraps them.",
        "# configure precision in the engine itself, e.g. DeepSpeed: {'fp16': {'enabled': True, 'loss_scale': 0}}\n"
        "# or {'bf16': {'enabled': True}}; Megatron: --fp16/--bf16, --initial-loss-scale",
        INFO, "preflight", (), (),
    ),
    Rule(
        "AMP213", "lightning-fp16-became-bf16", "Lightning runs bf16-mixed where 16-mixed was asked",
        "Lightning's Trainer and Fabric replace precision='16-mixed' by 'bf16-mixed' on a CPU, with one warning "
        "among their start-up lines. The run is mixed precision in bf16: no GradScaler, no loss scaling and bf16's "
        "8 significant bits, so it tests nothing of the fp16 run (its loss scale, its overflows) that will run on "
        "a GPU.",
        'fabric = Fabric(precision="bf16-mixed")   # on a CPU; "16-mixed" on CUDA\n'
        '# Trainer(precision="bf16-mixed") likewise\n'
        "# fp16 with its GradScaler on a CPU:\n"
        "# from lightning.fabric.plugins import MixedPrecision\n"
        '# plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))\n'
        "# Fabric(plugins=plugin)",
        INFO, "preflight", (r"AMP with fp16 is not supported on CPU\. Using `precision='bf16-mixed'` instead",), (),
    ),
    # ---- AMP3xx: model and optimizer wiring ----------------------------------------------------------------
    Rule(
        "AMP301", "optimizer-params-not-in-model", "The optimizer holds tensors that are not the model's parameters",
        "The optimizer was built before the model was moved, cast, wrapped or re-created, so it updates stale "
        "copies; their grads stay None and GradScaler reports 'No inf checks were recorded'.",
        "model = model.to(device)            # move/cast/wrap first\n"
        "opt = torch.optim.AdamW(model.parameters())   # then build the optimizer",
        ERROR, "preflight", (), (21,),
    ),
    Rule(
        "AMP302", "params-missing-from-optimizer", "Trainable parameters are missing from every optimizer",
        "They get gradients (and memory) but are never updated.",
        "opt.add_param_group({'params': missing_params})   # or freeze them: p.requires_grad_(False)",
        WARNING, "preflight", (), (21,),
    ),
    # ---- AMP4xx: GradScaler state machine (runtime guards) ---------------------------------------------------
    Rule(
        "AMP401", "unscale-per-microbatch", "unscale_() (clipping) runs on every micro-batch of gradient accumulation",
        "GradScaler allows one unscale_() per optimizer per update(). Clipping inside the accumulation loop "
        "calls it again on the next micro-batch.",
        "if (i + 1) % accum_steps == 0:        # accelerate: if accelerator.sync_gradients:\n"
        "    scaler.unscale_(opt)\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "    scaler.step(opt); scaler.update(); opt.zero_grad()",
        ERROR, "runtime", (_UNSCALE_TWICE,), (17, 18),
    ),
    Rule(
        "AMP402", "skip-without-update", "A step was skipped without calling scaler.update()",
        "The optimizer stays UNSCALED until update(); skipping update() after a grad-norm guard makes the next "
        "unscale_() raise.",
        "if not torch.isfinite(norm) or norm > limit:\n"
        "    opt.zero_grad(); scaler.update(); continue   # always update()",
        ERROR, "runtime", (_UNSCALE_TWICE,), (19,),
    ),
    Rule(
        "AMP403", "unscale-after-step", "unscale_() was called after scaler.step()",
        "Unscaling and clipping must happen before the step that uses the gradients.",
        "scaler.unscale_(opt)\nclip_grad_norm_(model.parameters(), max_norm)\nscaler.step(opt)\nscaler.update()",
        ERROR, "runtime", (r"unscale_\(\) is being called after step\(\)",), (),
    ),
    Rule(
        "AMP404", "step-twice", "scaler.step() was called twice for one optimizer with no scaler.update() between",
        "update() closes an iteration: it reads the inf checks, adjusts the scale and resets each optimizer to READY. "
        "A second step() before it raises: update() is missing after a step, or two losses were each stepped.",
        "scaler.scale(loss).backward()\nscaler.step(opt)\nscaler.update()   # after every step(opt), before the next\n"
        "# two losses, one optimizer: scaler.scale(loss_a + loss_b).backward(); then step and update once",
        ERROR, "runtime", (r"step\(\) has already been called since the last update\(\)",), (20,),
    ),
    Rule(
        "AMP405", "unscaled-backward", "backward() ran on an unscaled loss while a GradScaler is enabled",
        "The scale is created by the first scaler.scale(loss); without it, unscale_/step/update have no scale, "
        "and fp16 gradients are not protected from underflow.",
        "scaler.scale(loss).backward()     # Lightning manual optimization: self.manual_backward(loss)",
        ERROR, "runtime",
        (r"Attempted (step|unscale_|update) but _scale is None", r"Attempted \w+ but _growth_tracker is None",
         r"_growth_tracker initialized before _scale"),
        (22, 36),
    ),
    Rule(
        "AMP406", "no-inf-checks", "The optimizer's parameters got no gradients (No inf checks were recorded)",
        "GradScaler found no .grad in any of the optimizer's parameters: the optimizer holds none, they are frozen "
        "(a loaded adapter is, by default), unused in forward, cut off by reentrant checkpointing, or are not the "
        "tensors the model trains.",
        "opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])\n"
        "model.gradient_checkpointing_enable(\n"
        "    gradient_checkpointing_kwargs={'use_reentrant': False})\n"
        "# peft + reentrant checkpointing: model.enable_input_require_grads()",
        ERROR, "runtime", (r"No inf checks were recorded for this optimizer",), (21, 35),
    ),
    Rule(
        "AMP407", "update-without-step", "scaler.update() ran with no step() or unscale_() in this iteration",
        "update() needs at least one optimizer to have recorded an inf check since the last update().",
        "scaler.step(opt)    # call step (or unscale_) for each optimizer before scaler.update()",
        ERROR, "runtime", (r"No inf checks were recorded prior to update",), (),
    ),
    Rule(
        "AMP408", "clip-scaled-grads", "Gradients were clipped while still multiplied by the loss scale",
        "clip_grad_norm_ compares the scaled norm (times 65536 by default) to max_norm, and clip_grad_value_ "
        "caps each scaled entry at clip_value, so clipping is effectively always on and the updates shrink "
        "silently.",
        "scaler.scale(loss).backward()\nscaler.unscale_(opt)          # before clipping\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\nscaler.step(opt); scaler.update()",
        WARNING, "runtime", (), (24,),
    ),
    Rule(
        "AMP409", "scheduler-on-skipped-step", "The LR scheduler stepped on a step the GradScaler skipped",
        "The optimizer did not update, but the learning-rate schedule advanced, so the schedule drifts.",
        "scale_before = scaler.get_scale(); scaler.step(opt); scaler.update()\n"
        "if scaler.get_scale() >= scale_before: scheduler.step()"
        "   # accelerate: if not accelerator.optimizer_step_was_skipped",
        INFO, "runtime", (r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`",), (23,),
        escalates=((WARNING, "the skipped steps are a large share of the schedule or moved the learning rate"),),
    ),
    Rule(
        "AMP410", "scaler-state-not-restored", "A resume restored the optimizer but not the GradScaler",
        "The loss scale is learned state. Without scaler.load_state_dict it restarts at 65536, so the first steps "
        "overflow and are skipped.",
        "torch.save({'model': model.state_dict(), 'opt': opt.state_dict(),\n"
        "            'scaler': scaler.state_dict()}, path)\n"
        "scaler.load_state_dict(ckpt['scaler'])",
        WARNING, "runtime",
        (r"The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler",
         r"A GradScaler instance may only be pickled at the beginning of an iteration"),
        (36,),
    ),
    Rule(
        "AMP411", "ranks-disagree-on-skip", "Ranks disagreed on skipping a step or on the loss scale",
        "Every rank must take the same decision after unscale_(): skip the step or apply it, and back off or grow "
        "the scale. When they differ, the replicas (or the shards of one model) are updated on some ranks only, and "
        "the next gradient reduction mixes gradients multiplied by different loss scales.",
        "# FSDP1: scaler = ShardedGradScaler()  (all-reduces found_inf)\n"
        "# own sharding: dist.all_reduce(found_inf, op=dist.ReduceOp.MAX) before deciding to skip",
        ERROR, "runtime", (), (),
    ),
    Rule(
        "AMP412", "optimizer-step-bypasses-scaler", "optimizer.step() ran directly on gradients the GradScaler scaled",
        "scaler.scale(loss).backward() multiplies every gradient by the loss scale (65536 at first); only "
        "scaler.step(optimizer) divides it back out and skips a step with inf/NaN gradients. A direct "
        "optimizer.step() applies inf/NaN gradients, and its update is that many times too large (SGD) or its eps "
        "that many times too small (Adam).",
        "scaler.scale(loss).backward()\nscaler.step(optimizer)   # not optimizer.step()\nscaler.update()",
        ERROR, "runtime", (), (),
    ),
    Rule(
        "AMP413", "backward-inside-autocast", "backward() or optimizer.step() ran inside an autocast region",
        "Autocast should wrap only the forward pass and the loss computation (PyTorch AMP docs): backward ops "
        "already run in the dtype autocast chose for their forward ops, and the fp16 copies of the weights that "
        "autocast caches for the region go stale once the optimizer updates them inside it.",
        "with torch.autocast(device_type, dtype=torch.float16):\n    loss = loss_fn(model(x), y)\n"
        "scaler.scale(loss).backward()   # outside the with block\nscaler.step(optimizer); scaler.update()",
        WARNING, "runtime", (), (),
    ),
    # ---- AMP5xx: dtype mismatches --------------------------------------------------------------------------------
    Rule(
        "AMP501", "dtype-mismatch", "Tensors of two dtypes meet in one op (half parameters, float inputs)",
        "A module was cast with .half()/.to(dtype) (or loaded in half) while its inputs or other modules kept another "
        "dtype. Outside autocast every op needs matching dtypes; inside it, ops autocast does not cast still do: CPU "
        "autocast leaves layer_norm alone (CUDA autocast runs it in fp32), so fp16/bf16 LayerNorm weights fail there.",
        "model.float()   # keep parameters fp32 (transformers: from_pretrained(..., torch_dtype=torch.float32))\n"
        "with torch.autocast(device_type, dtype=torch.bfloat16):   # autocast picks each op's dtype\n"
        "    out = model(x)\n# or cast the input to the weights' dtype: model(x.to(next(model.parameters()).dtype))",
        ERROR, "crash", _HALF_FLOAT, (31, 32, 35),
    ),
    Rule(
        "AMP502", "bce-unsafe-to-autocast", "binary_cross_entropy on probabilities under fp16 autocast",
        "BCELoss takes probabilities after a sigmoid; in fp16 the sigmoid saturates to exactly 0 or 1 and log(0) is "
        "-inf, so torch refuses binary_cross_entropy inside fp16 autocast.",
        "loss_fn = torch.nn.BCEWithLogitsLoss()   # give it the logits, drop the sigmoid: it is fused and safe\n"
        "loss = loss_fn(logits, target)",
        ERROR, "crash", (r"binary_cross_entropy and torch\.nn\.BCELoss are unsafe to autocast",), (),
    ),
    Rule(
        "AMP503", "constant-overflows-half", "A constant does not fit in the half-precision dtype",
        "float16 holds values up to 65504. A fill or mask constant such as -1e9 or 1e5 written into an fp16 tensor "
        "(masked_fill, fill_, torch.full) cannot be represented, and torch refuses it.",
        "scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)   # instead of -1e9 / -1e4 literals",
        ERROR, "crash", (r"value cannot be converted to type (at|c10)::(Half|BFloat16) without overflow",), (),
    ),
    Rule(
        "AMP504", "no-half-kernel", "An op has no float16/bfloat16 kernel on this device",
        "Outside autocast a half-precision tensor goes to the op as is, and some ops have no float16 (or bfloat16) "
        "kernel on some devices or torch versions (CPU matmuls in older torch, some CUDA ops in bfloat16).",
        "with torch.autocast(device_type, dtype=torch.float16):   # autocast runs such ops in fp32\n"
        "    out = model(x)\n# or keep the model in fp32 on CPU: model.float()",
        ERROR, "crash", (r"\"(?!_amp_)[^\"\n]{1,120}\" not implemented for '(Half|BFloat16)'",), (),
    ),
    # ---- AMP6xx: numerics while training (watch) ------------------------------------------------------------
    Rule(
        "AMP601", "nonfinite-forward", "A module produced inf/NaN in the forward pass",
        "fp16 overflows above 65504. Once an activation is inf, the loss is NaN and every step is skipped. A module "
        "whose weights already hold inf/NaN (written by an optimizer step) outputs NaN whatever its input; its "
        "finding then says so and gives that fix instead.",
        "# upcast the module that overflows, e.g. run it outside autocast:\n"
        "with torch.autocast(device_type, enabled=False):\n    y = module(x.float())\n"
        "# or train in bf16, clamp activations, softmax(..., dtype=torch.float32)",
        ERROR, "watch", (r"inf/nan detected",), (25, 28, 29),
    ),
    Rule(
        "AMP602", "nonfinite-backward", "A module's gradient became inf/NaN in the backward pass",
        "Gradients overflow the scaled fp16 range, or the forward produced values whose derivative is infinite.",
        "# the GradScaler skips such steps; if it keeps happening, see AMP603 and upcast the module named here",
        WARNING, "watch", (r"Function '\w+' returned (nan|inf) values",), (28, 30),
    ),
    Rule(
        "AMP603", "loss-scale-collapse", "The loss scale keeps falling",
        "The scaler halves the scale on every step with inf gradients. If the infs come from the forward pass "
        "(an activation above 65504), lowering the scale never helps and the scale heads to 0. fairseq's and "
        "DeepSpeed's own loss scalers stop the run at their minimum scale ('Minimum loss scale reached', 'Current "
        "loss scale already at minimum'): a lower minimum only postpones that.",
        "# find the module that overflows (AMP601) and upcast it, or train in bf16:\n"
        "with torch.autocast(device_type, dtype=torch.bfloat16): ...\n"
        "# a loss that explodes (a learning rate too high) overflows at any scale:\n"
        "# lower the learning rate, warm it up, or clip the gradients\n"
        "# fairseq: --bf16 instead of --fp16; --fp16-scale-tolerance 0.25 keeps the\n"
        "#   scale through occasional spikes (it falls once 25% of steps overflow);\n"
        "#   --min-loss-scale only postpones the stop; after it, fairseq's log names\n"
        "#   the first module with inf/NaN (\"NaN detected in output of ...\")\n"
        "# DeepSpeed: \"bf16\": {\"enabled\": true} instead of \"fp16\"; its\n"
        "#   \"fp16\": {\"min_loss_scale\": ...} only postpones the stop",
        ERROR, "watch",
        (r"Current loss scale already at minimum", r"Minimum loss scale reached",
         r"loss scale[^\n]{0,200}(minimum|collapsed)"),
        (25, 26, 27),
    ),
    Rule(
        "AMP604", "skipped-steps", "The loss scaler skipped optimizer steps",
        "A skipped step is a batch of data that taught the model nothing; a run of them means the model is not "
        "training.",
        "# occasional skips at the start are normal; consecutive skips: see AMP601/AMP603",
        WARNING, "watch", (r"OVERFLOW![^\n]{0,200}Skipping step", r"Gradient overflow\. +Skipping step",
                            r"gradient overflow detected, ignoring gradient"), (23, 26, 27),
        escalates=((INFO, "only the first steps were skipped, while the scale calibrated"),),
    ),
    Rule(
        "AMP605", "gradient-underflow", "Gradients would flush to zero in the low-precision format",
        "Values below a format's smallest subnormal become 0 (fp16: 2**-24 ≈ 6e-8 after scaling).",
        "# raise the loss scale (init_scale / growth_interval) or use bf16",
        WARNING, "watch", (), (),
    ),
    Rule(
        "AMP606", "activation-headroom", "Activations are close to the fp16 maximum (65504)",
        "An activation within a small factor of 65504 overflows to inf after the next growth in data or weights.",
        "# run this module in fp32 or bf16, or rescale/clamp its output",
        WARNING, "watch", (), (25, 29),
    ),
    Rule(
        "AMP607", "lost-updates", "Optimizer updates round away in low-precision weights",
        f"w + Δ == w when |Δ| < half an ulp of w: always below {lost_below(FP16)} (fp16) or {lost_below(BF16)} "
        "(bf16), and up to twice that depending on w.",
        "opt = ampdoctor.MasterWeights(opt)   # fp32 master weights",
        WARNING, "watch", (), (15, 39),
    ),
    Rule(
        "AMP608", "nonfinite-grad-norm", "The gradient norm is not finite",
        "clip_grad_norm_ on inf gradients zeroes or NaNs them, and a step taken on them writes NaN into the "
        "weights. An enabled GradScaler skips such steps (let it, instead of raising before it); with no GradScaler "
        "nothing does, and the finding's fix fits that setup.",
        "scaler.unscale_(opt)\n"
        "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # no error_if_nonfinite\n"
        "scaler.step(opt); scaler.update()",
        WARNING, "watch", (r"The total norm of order \S+ for gradients from `parameters` is non-finite",), (30,),
    ),
    Rule(
        "AMP609", "nonfinite-input", "The model's input already holds inf/NaN",
        "A batch that arrives with NaN or inf makes every activation, the loss and every gradient non-finite; the "
        "GradScaler then skips the step and lowers the scale, which never helps. No layer is at fault.",
        "# find the bad samples before the forward:\nbad = ~torch.isfinite(x).flatten(1).all(1)\n"
        "assert not bad.any(), f\"bad samples: {bad.nonzero().flatten().tolist()}\"\n"
        "# fix the data (or its normalisation: a std of 0 divides by zero), or drop those samples",
        ERROR, "watch", (),
    ),
    Rule(
        "AMP610", "nan-loss-hidden", "The logged loss hides NaN/inf losses (logging_nan_inf_filter)",
        "With logging_nan_inf_filter=True (the default) the Trainer adds the average of the earlier losses in place "
        "of a NaN/inf micro-batch loss, so the logged loss stays finite while training has diverged.",
        "TrainingArguments(..., logging_nan_inf_filter=False)   # see the NaN in the logs\n"
        "# then find where it starts: AmpDoctorCallback(activations=True)",
        WARNING, "watch",
    ),
    Rule(
        "AMP611", "grad-norm-clipped", "Every step was clipped: the logged and watched norms are after clipping",
        "clip_grad_norm_ returns the norm before clipping; the optimizer and the gradient statistics see the clipped "
        "gradients. A run that clips every step hides how large its gradients are.",
        "# the pre-clip norms are in report['clipping'] (peak, last, clipped/calls)\n"
        "TrainingArguments(max_grad_norm=...)  # or Trainer(gradient_clip_val=...): raise it, or find the spike",
        INFO, "watch",
    ),
    Rule(
        "AMP612", "no-progress", "Iterations ran backward but updated no weight",
        "Backward computed gradients that no optimizer step used (a skipped step of any loss scaler, a loop that "
        "zeroes the gradients before it steps), or the optimizer stepped and moved none of the weights it was "
        "given: the run spends its compute and learns nothing, whatever the cause.",
        "# step after every backward that should count, and let one scaler decide the skips:\n"
        "scaler.scale(loss).backward()\nscaler.step(opt)\nscaler.update()\nopt.zero_grad()",
        WARNING, "watch",
        escalates=((ERROR, "no optimizer step updated a weight, or most backward calls went to no step"),),
    ),
    Rule(
        "AMP613", "loss-not-finite", "The loss is inf/NaN",
        "A non-finite loss gives non-finite gradients; without a GradScaler to skip the step they reach the "
        "weights. It usually starts in the forward pass (an fp16 overflow, a log of 0, a division by 0).",
        "ampdoctor.watch(model, opt, scaler, activations=True)   # names the first module with an inf/NaN output",
        ERROR, "watch",
        escalates=((WARNING, "the last sampled loss was finite again"),),
    ),
    Rule(
        "AMP614", "loss-frozen", "The loss stayed bit-identical while the weights changed",
        "A loss that does not move with the weights is not computed from them: a copy of the model, a detached "
        "output, a cached value, or a loss too coarse (fp16/bf16) to show the change.",
        "loss = criterion(model(x).float(), y)   # from the model the optimizer steps, in fp32",
        WARNING, "watch",
    ),
    Rule(
        "AMP615", "loss-diverging", "The loss is growing",
        "A loss that ends far above where it started is diverging: a learning rate too high, an update that "
        "bypassed the loss scaler, or gradients still multiplied by a loss scale.",
        "# lower the learning rate, or warm it up; check that every update goes through scaler.step(opt)",
        WARNING, "watch",
    ),
    Rule(
        "AMP616", "weights-not-finite", "Weights are inf/NaN",
        "Once a weight is inf/NaN every later forward pass is too: the run is broken from that step on. An "
        "optimizer step wrote it (an Adam eps that rounds to 0 in fp16, an update that bypassed the scaler), or "
        "code outside the optimizer did.",
        "scaler.step(opt)   # never opt.step() directly while a GradScaler scales the loss\n"
        "model.float()      # fp32 weights; keep fp16 for autocast",
        ERROR, "watch",
    ),
    Rule(
        "AMP617", "params-without-grad", "Trainable parameters never receive a gradient",
        "A trainable parameter the loss does not reach is never updated: an unused module, a branch the forward "
        "skips, a detach() or a no_grad() around its part of the model. When none receives one, nothing trains.",
        "for n, p in model.named_parameters():\n"
        "    if p.requires_grad and p.grad is None: print(n)   # after backward: freeze them or use them",
        INFO, "watch",
        escalates=((ERROR, "no trainable parameter received a gradient"),),
    ),
    Rule(
        "AMP618", "clip-sees-nothing", "The gradient clip clips no parameters",
        "clip_grad_norm_ was given no parameters (or not the ones that have gradients) and returned a norm of 0: "
        "a filter() or generator passed to the optimizer first is empty by the time the clip iterates it, so the "
        "clip never clips.",
        "params = [p for p in model.parameters() if p.requires_grad]   # a list, not filter(): it can be reused\n"
        "opt = torch.optim.AdamW(params); torch.nn.utils.clip_grad_norm_(params, 1.0)",
        WARNING, "watch",
    ),
    Rule(
        "AMP619", "average-updates-lost", "Updates of an averaged (EMA/SWA) copy round away",
        "An averaged copy kept in fp16/bf16 moves each entry by (1 - decay) * (w - average) per update: with decay "
        "0.999 that is 0.1% of the gap, below half an ulp of most entries, so the average stays where an early step "
        "left it. The optimizer's weights may be fine; the weights you evaluate and save are not.",
        "# keep the average in fp32 (it is never trained, so fp32 costs memory only):\n"
        "ema = EMAModel(model.parameters())            # diffusers: no .to(dtype=torch.float16)\n"
        "averaged = AveragedModel(model).float()       # torch.optim.swa_utils",
        WARNING, "watch",
    ),
    # ---- AMP7xx: the numerics audit (each low-precision op re-run in fp32 on audited steps) --------------------
    Rule(
        "AMP701", "constant-not-held", "A constant of an op is 0 or inf in the op's dtype",
        "An eps, a clamp floor or a fill value is converted to the tensor's dtype: 1e-12 (F.normalize's eps) and "
        "torch.finfo(torch.float32).tiny are 0 in fp16, -1e9 is -inf. The guard then guards nothing: a zero norm "
        "divides 0 by 0, a probability clamped at 0 gives log(0) = -inf, a fully masked row gives NaN.",
        "# a constant the dtype holds:\n"
        "eps = torch.finfo(x.dtype).tiny      # 6.1e-05 in fp16, 1.2e-38 in bf16\n"
        "x = x.clamp_min(eps)\n"
        "# or compute the op in fp32:\n"
        "y = torch.nn.functional.normalize(x.float(), dim=-1).to(x.dtype)",
        WARNING, "watch", escalates=((ERROR, "NaN or inf follows it in the same step"),),
    ),
    Rule(
        "AMP702", "op-overflow", "An op gave inf/NaN where fp32 gives finite values",
        "The op's result does not fit the format (fp16's largest number is 65504): x.pow(2) of activations above "
        "256, exp of scores above 11, a variance of large values. Inside a norm the inf becomes rsqrt(inf) = 0, so "
        "the output is silently 0 rather than NaN.",
        "# compute the op in fp32, as LlamaRMSNorm does:\n"
        "variance = x.float().pow(2).mean(-1, keepdim=True)\n"
        "# or run the module outside autocast / keep a frozen half module in fp32:\n"
        "with torch.autocast(device_type, enabled=False):\n    y = module(x.float())",
        ERROR, "watch",
    ),
    Rule(
        "AMP703", "op-lost-values", "An op gave 0 where fp32 gives a normal number",
        "No rounding turns a normal number into 0: the op lost the value inside (an overflow in an intermediate "
        "of a fused kernel, a product with a constant that is 0 in the format).",
        "# compute the op in fp32:\n"
        "with torch.autocast(device_type, enabled=False):\n    y = op(x.float())",
        WARNING, "watch",
    ),
    Rule(
        "AMP704", "integer-precision-lost", "Positions, timesteps or indices lose whole units in a cast",
        "bf16 holds whole numbers exactly only up to 256 and fp16 up to 2048: position 299 becomes 300 in bf16, "
        "a diffusion timestep 998.4 becomes 1000, so rotary angles and timestep embeddings of neighbours collide.",
        "# compute positions and timesteps in fp32, outside autocast:\n"
        "with torch.autocast(device_type, enabled=False):\n"
        "    angles = positions.float()[..., None] * inv_freq.float()\n"
        "# diffusers: keep timesteps int64/float32: do not .to(dtype=weight_dtype) them",
        WARNING, "watch",
    ),
    Rule(
        "AMP705", "op-precision-loss", "An op lost far more precision than rounding explains",
        "Rounding an op's result costs at most half a unit of the format's roundoff; an op many units away from "
        "the same op in fp32 on the same inputs accumulates or cancels in the low-precision format.",
        "# compute the op in fp32 (a reduction: its dtype= argument):\n"
        "y = x.sum(dim, dtype=torch.float32)\n"
        "with torch.autocast(device_type, enabled=False):\n    y = op(x.float())",
        WARNING, "watch",
    ),
    Rule(
        "AMP706", "autocast-bypassed", "A matmul or convolution computes in fp32 inside an autocast region",
        "Autocast casts the inputs of out-of-place matmuls and convolutions; an out= or in-place variant "
        "(torch.mm(a, b, out=buf), buf.addmm_(a, b)) or a kernel autocast does not know receives fp32 and runs at "
        "fp32 speed and memory.",
        "# let autocast see the op: the out-of-place call\n"
        "y = bias + a @ b            # not buf.addmm_(a, b) or torch.mm(a, b, out=buf)\n"
        "# or cast the inputs yourself:\n"
        "y = torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16))",
        WARNING, "watch",
    ),
    Rule(
        "AMP707", "state-not-finite", "A buffer or optimizer state holds inf/NaN",
        "BatchNorm's running statistics are updated by the forward, also on a step the GradScaler skips, so one "
        "overflowing batch writes inf/NaN into them and every evaluation after it is NaN. Optimizer state that holds "
        "NaN writes NaN into the weights at the next step.",
        "# keep the norm in fp32 and its input finite; after a skipped step, restore the statistics:\n"
        "for m in model.modules():\n"
        "    if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):\n"
        "        m.reset_running_stats()\n"
        "# or update the running statistics only on steps the scaler did not skip",
        ERROR, "watch",
    ),
    Rule(
        "AMP708", "recompute-autocast-mismatch", "An activation checkpoint recomputes under another autocast state",
        "The recompute in the backward must see the forward's autocast state; a hand-written checkpoint that does "
        "not save it recomputes under whatever is on when backward() runs, so the gradients belong to other "
        "activations than the forward used (an fp16 recompute of an fp32 forward overflows: NaN gradients with a "
        "finite loss).",
        "# torch's checkpoint saves and restores the autocast state:\n"
        "y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)\n"
        "# a hand-written one: save torch.is_autocast_enabled()/get_autocast_dtype() in forward\n"
        "# and recompute inside torch.autocast(device_type, dtype=..., enabled=...)",
        ERROR, "watch",
    ),
)

_BY_CODE = {r.code: r for r in RULES}
_BY_NAME = {r.name: r for r in RULES}


def escalated(finding: Finding, severity: Severity, detail: str | None = None) -> Finding:
    """Return ``finding`` at ``severity`` (and with ``detail``), one its rule declares (``Rule.escalates``).

    Raises:
        ValueError: the catalog gives the rule no such severity.
    """
    rule = get_rule(finding.code)
    if severity not in rule.severities:
        raise ValueError(f"{rule.code} findings are {' or '.join(s.value for s in rule.severities)} in the catalog, "
                         f"not {severity.value}: declare when in its Rule(escalates=...)")
    return replace(finding, severity=severity, detail=finding.detail if detail is None else detail)


def with_fix_command(finding: Finding, command: str) -> Finding:
    """Return ``finding`` with its fix saying ``command`` where it says `FIX_COMMAND`: the run's own script and
    arguments (``ampdoctor run --fix finetune.py --lr 1e-4``), or how its entry point asks (``%ampdoctor --fix``).

    >>> f = get_rule("AMP101").finding("fc", "fc.weight is float16")
    >>> with_fix_command(f, "ampdoctor run --fix finetune.py").fix.splitlines()[1]
    '# or run it as: ampdoctor run --fix finetune.py'
    """
    try:
        fix = finding.fix or get_rule(finding.code).fix
    except KeyError:
        return finding
    return replace(finding, fix=fix.replace(FIX_COMMAND, command)) if FIX_COMMAND in fix else finding


def get_rule(code_or_name: str) -> Rule:
    """Return the rule with this code (``"AMP101"``) or name (``"fp16-trainable-params"``).

    >>> get_rule("amp101").name
    'fp16-trainable-params'
    """
    key = code_or_name.strip()
    rule = _BY_CODE.get(key.upper()) or _BY_NAME.get(key.lower())
    if rule is None:
        raise KeyError(f"no rule {code_or_name!r}; codes run from {RULES[0].code} to {RULES[-1].code} "
                       "(see `ampdoctor rules`)")
    return rule


def select(prefixes: Iterable[str] = ("AMP",), phase: str | None = None) -> list[Rule]:
    """Return the rules whose codes start with any of ``prefixes``, optionally of one phase.

    >>> [r.code for r in select(["AMP10"], phase="preflight")][:2]
    ['AMP101', 'AMP102']
    """
    prefixes = tuple(p.upper() for p in prefixes)
    return [r for r in RULES if r.code.startswith(prefixes) and (phase is None or r.phase == phase)]


MAX_TEXT = 200_000  # an error sits at the end of a log; reading only its tail bounds the work on huge input
_MAX_LINE = 2_000  # every pattern matches within one line; longer lines are cut


def rules_for_error(text: str) -> list[Rule]:
    """Return the rules whose error texts occur in ``text`` (an exception message or a traceback).

    Work is bounded: only the last 200,000 characters are read, line by line, each cut to 2,000 characters,
    and every pattern is linear (no nested quantifiers), so hostile input cannot make this slow.

    >>> [r.code for r in rules_for_error("RuntimeError: step() has already been called since the last update().")]
    ['AMP404']
    """
    lines = [line[:_MAX_LINE] for line in text[-MAX_TEXT:].splitlines()]
    tail = "\n".join(lines)
    return [r for r in RULES if r.matches(tail)]
