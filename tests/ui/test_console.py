"""The console's renderables: one row per group of findings, fitted to 80 or 120 columns, plain lines in a pipe.

The piped text is pinned whole (rich's way: render to a StringIO console and compare). For every layout, piped or
on a terminal, each line fits the width, every module name appears whole and nothing is cut with an ellipsis.
"""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.report import Report
from ampdoctor.ui.console import findings_table, rule_panel, rules_table

CAUSE = ("trainable float16 while GradScaler('cuda') is enabled, so scaler.unscale_() will raise 'Attempting to "
         "unscale FP16 gradients.' All 40 trainable parameters are float16: the whole model was cast, e.g. "
         "torch_dtype=torch.float16 or .half().")
LORA = [f"base_model.model.encoder.layer.{i // 4}.attention.self.{('query', 'value')[i // 2 % 2]}.lora_{'AB'[i % 2]}"
        f".default" for i in range(20)]


def lora_report() -> Report:
    """Return the report of a LoRA model cast with .half(): one AMP101 per adapter module, and three others."""
    findings = [Finding("AMP101", Severity.ERROR, m, f"{m}.weight (float16, [8, 384]) is {CAUSE}", cause=CAUSE)
                for m in LORA]
    findings += [
        Finding("AMP104", Severity.ERROR, "optimizer[0] group 0", "AdamW eps=1e-08 is 0 in float16, whose smallest "
                "subnormal is 5.96e-08; the group updates 40 float16 tensors."),
        Finding("AMP202", Severity.WARNING, "GradScaler", "GradScaler('cuda') was built with enabled=True, but "
                "torch.cuda.is_available() is False, so torch disabled it at construction."),
        Finding("AMP409", Severity.INFO, "LambdaLR", "scheduler.step() ran after the skipped step 3.", step=3),
    ]
    return Report(findings=findings)


def render(renderable, width: int, terminal: bool) -> str:
    console = Console(file=io.StringIO(), width=width, force_terminal=terminal, color_system=None)
    console.soft_wrap = not terminal  # as ampdoctor's own console (ui.plain.console): plain lines are written whole
    console.print(renderable)
    return console.file.getvalue()


def assert_fits(text: str, width: int, names: list[str]) -> None:
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    missing = [n for n in names if not re.search(rf"(^|\s){re.escape(n)}(:|\s|$)", text, re.MULTILINE)]
    assert missing == []
    assert "…" not in text


REPORT_80 = """\
ampdoctor findings
AMP101 error 20 modules: Trainable float16 parameters under an fp16 GradScaler
    base_model.model.encoder.layer.0.attention.self.query.lora_A.default
    base_model.model.encoder.layer.0.attention.self.query.lora_B.default
    base_model.model.encoder.layer.0.attention.self.value.lora_A.default
    base_model.model.encoder.layer.0.attention.self.value.lora_B.default
    base_model.model.encoder.layer.1.attention.self.query.lora_A.default
    base_model.model.encoder.layer.1.attention.self.query.lora_B.default
    base_model.model.encoder.layer.1.attention.self.value.lora_A.default
    base_model.model.encoder.layer.1.attention.self.value.lora_B.default
    and 12 more (all are in the JSON report written with --json PATH)
    Parameters in these 20 modules are trainable float16 while
    GradScaler('cuda') is enabled, so scaler.unscale_() will raise 'Attempting
    to unscale FP16 gradients.' All 40 trainable parameters are float16: the
    whole model was cast, e.g. torch_dtype=torch.float16 or .half().
AMP104 error optimizer[0] group 0: Adam eps is below what the parameter or state
    dtype can represent
    AdamW eps=1e-08 is 0 in float16, whose smallest subnormal is 5.96e-08; the
    group updates 40 float16 tensors.
AMP202 warning GradScaler: GradScaler('cuda') quietly disabled itself: CUDA is
    not available
    GradScaler('cuda') was built with enabled=True, but
    torch.cuda.is_available() is False, so torch disabled it at construction.
AMP409 info (step 3) LambdaLR: The LR scheduler stepped on a step the GradScaler
    skipped
    scheduler.step() ran after the skipped step 3.
how to fix
AMP101 fp16-trainable-params: Trainable float16 parameters under an fp16
    GradScaler
    GradScaler unscales gradients in the parameter dtype. It refuses float16
    gradients because an fp16 optimizer update loses small steps (fp16 keeps 11
    significant bits), so the first unscale_() raises without naming the
    parameter. AMP expects fp32 parameters with fp16 compute under
    torch.autocast.
    ampdoctor.upcast_trainable_params_(model)
    # or run it as: ampdoctor run --fix train.py
    # by hand: for p in model.parameters():
    #     if p.requires_grad: p.data = p.data.float()
    # peft: get_peft_model(model, config, autocast_adapter_dtype=True)
    #   (LoRA adapters only; modules_to_save copies stay half: upcast them)
    # diffusers: cast_training_params(model, dtype=torch.float32)
AMP104 adam-eps-underflow: Adam eps is below what the parameter or state dtype
    can represent
    Adam divides by sqrt(v) + eps. fp16's smallest subnormal is 2**-24 ≈ 6e-8,
    so eps=1e-8 becomes 0 and entries with zero gradient give 0/0 = NaN.
    opt = torch.optim.AdamW(params, eps=1e-4)  # or fused=True: eps in fp32
    # better: keep fp32 master weights: opt = ampdoctor.MasterWeights(opt)
AMP202 cuda-scaler-disabled: GradScaler('cuda') quietly disabled itself: CUDA is
    not available
    torch disables a 'cuda' GradScaler with one UserWarning when CUDA is
    missing. Training then runs with no loss scaling, and fp16 gradients can
    underflow to zero unnoticed.
    scaler = torch.amp.GradScaler('cpu')   # match the device you train on
AMP409 scheduler-on-skipped-step: The LR scheduler stepped on a step the
    GradScaler skipped
    The optimizer did not update, but the learning-rate schedule advanced, so
    the schedule drifts.
    scale_before = scaler.get_scale(); scaler.step(opt); scaler.update()
    if scaler.get_scale() >= scale_before: scheduler.step()   # accelerate: if
    # not accelerator.optimizer_step_was_skipped
"""

REPORT_120 = """\
ampdoctor findings
AMP101 error 20 modules: Trainable float16 parameters under an fp16 GradScaler
    base_model.model.encoder.layer.0.attention.self.query.lora_A.default
    base_model.model.encoder.layer.0.attention.self.query.lora_B.default
    base_model.model.encoder.layer.0.attention.self.value.lora_A.default
    base_model.model.encoder.layer.0.attention.self.value.lora_B.default
    base_model.model.encoder.layer.1.attention.self.query.lora_A.default
    base_model.model.encoder.layer.1.attention.self.query.lora_B.default
    base_model.model.encoder.layer.1.attention.self.value.lora_A.default
    base_model.model.encoder.layer.1.attention.self.value.lora_B.default
    and 12 more (all are in the JSON report written with --json PATH)
    Parameters in these 20 modules are trainable float16 while GradScaler('cuda') is enabled, so scaler.unscale_() will
    raise 'Attempting to unscale FP16 gradients.' All 40 trainable parameters are float16: the whole model was cast,
    e.g. torch_dtype=torch.float16 or .half().
AMP104 error optimizer[0] group 0: Adam eps is below what the parameter or state dtype can represent
    AdamW eps=1e-08 is 0 in float16, whose smallest subnormal is 5.96e-08; the group updates 40 float16 tensors.
AMP202 warning GradScaler: GradScaler('cuda') quietly disabled itself: CUDA is not available
    GradScaler('cuda') was built with enabled=True, but torch.cuda.is_available() is False, so torch disabled it at
    construction.
AMP409 info (step 3) LambdaLR: The LR scheduler stepped on a step the GradScaler skipped
    scheduler.step() ran after the skipped step 3.
how to fix
AMP101 fp16-trainable-params: Trainable float16 parameters under an fp16 GradScaler
    GradScaler unscales gradients in the parameter dtype. It refuses float16 gradients because an fp16 optimizer update
    loses small steps (fp16 keeps 11 significant bits), so the first unscale_() raises without naming the parameter. AMP
    expects fp32 parameters with fp16 compute under torch.autocast.
    ampdoctor.upcast_trainable_params_(model)
    # or run it as: ampdoctor run --fix train.py
    # by hand: for p in model.parameters():
    #     if p.requires_grad: p.data = p.data.float()
    # peft: get_peft_model(model, config, autocast_adapter_dtype=True)
    #   (LoRA adapters only; modules_to_save copies stay half: upcast them)
    # diffusers: cast_training_params(model, dtype=torch.float32)
AMP104 adam-eps-underflow: Adam eps is below what the parameter or state dtype can represent
    Adam divides by sqrt(v) + eps. fp16's smallest subnormal is 2**-24 ≈ 6e-8, so eps=1e-8 becomes 0 and entries with
    zero gradient give 0/0 = NaN.
    opt = torch.optim.AdamW(params, eps=1e-4)  # or fused=True: eps in fp32
    # better: keep fp32 master weights: opt = ampdoctor.MasterWeights(opt)
AMP202 cuda-scaler-disabled: GradScaler('cuda') quietly disabled itself: CUDA is not available
    torch disables a 'cuda' GradScaler with one UserWarning when CUDA is missing. Training then runs with no loss
    scaling, and fp16 gradients can underflow to zero unnoticed.
    scaler = torch.amp.GradScaler('cpu')   # match the device you train on
AMP409 scheduler-on-skipped-step: The LR scheduler stepped on a step the GradScaler skipped
    The optimizer did not update, but the learning-rate schedule advanced, so the schedule drifts.
    scale_before = scaler.get_scale(); scaler.step(opt); scaler.update()
    if scaler.get_scale() >= scale_before: scheduler.step()   # accelerate: if not
                                                              # accelerator.optimizer_step_was_skipped
"""


@pytest.mark.parametrize("width, expected", [(80, REPORT_80), (120, REPORT_120)])
def test_piped_report_is_plain_lines_one_row_per_group(width, expected):
    """Was: a box-drawn table with one AMP101 row per module (4 shown, then "and 16 more"), names cut at 80 columns."""
    assert render(lora_report(), width, terminal=False) == expected


@pytest.mark.parametrize("terminal", [False, True], ids=["piped", "terminal"])
@pytest.mark.parametrize("width", [80, 120])
def test_report_fits_the_width_with_every_name_whole(width, terminal):
    text = render(lora_report(), width, terminal)
    assert_fits(text, width, LORA[:8] + ["optimizer[0] group 0", "GradScaler", "LambdaLR"])
    assert "and 12 more (all are in the JSON report written with --json PATH)" in text
    assert all(name not in text for name in LORA[8:])


@pytest.mark.parametrize("terminal", [False, True], ids=["piped", "terminal"])
def test_one_finding_group_is_one_row(terminal):
    text = render(findings_table(lora_report().findings), 100, terminal)
    assert len(re.findall(r"^AMP101\b", text, re.MULTILINE)) == 1
    assert "Parameters in these 20 modules are trainable float16" in text


def test_a_terminal_gets_a_table_and_a_pipe_gets_no_box_drawing():
    piped, terminal = render(lora_report(), 80, False), render(lora_report(), 80, True)
    assert not set("│┃━─╭╰") & set(piped)
    assert "────" in terminal and "╭─ AMP101 fp16-trainable-params" in terminal


def test_the_json_report_is_named_only_with_how_to_write_it():
    """Was a false hint: "see the JSON report" where none was written; it is written only with --json PATH."""
    findings = [Finding("AMP104", Severity.ERROR, f"optimizer[{i}] group 0", f"AdamW {i} eps=1e-08 is 0.")
                for i in range(7)]
    report = Report(findings=findings + lora_report().findings, changes=[f"{m}: upcast" for m in LORA * 2])
    piped = " ".join(render(report, 80, False).split())
    assert piped.count("JSON report") == 3   # places, AMP104 groups, changes
    assert piped.count("JSON report") == piped.count("JSON report written with --json PATH")
    terminal = render(report, 80, True)   # a table cell may wrap beside the next column: count the two ends
    assert terminal.count("JSON") == terminal.count("--json PATH") == 3


def test_groups_beyond_the_first_few_of_a_code_are_counted():
    findings = [Finding("AMP104", Severity.ERROR, f"optimizer[{i}] group 0", f"AdamW {i} eps=1e-08 is 0.")
                for i in range(6)]
    text = render(findings_table(findings), 80, False)
    assert [line.split(" ")[2] for line in text.splitlines() if line.startswith("AMP104")] == [
        "optimizer[0]", "optimizer[1]", "optimizer[2]", "optimizer[3]", "and"]
    assert "AMP104 error and 2 more AMP104 findings like the above" in text


def test_a_child_process_and_a_step_are_named():
    finding = Finding("AMP603", Severity.ERROR, "GradScaler", "loss scale fell.", step=7,
                      process="pid 4242: python train.py --epochs 1")
    assert render(findings_table([finding]), 80, False) == (
        "ampdoctor findings\n"
        "AMP603 error (step 7) GradScaler: The loss scale keeps falling\n"
        "    in pid 4242: python train.py --epochs 1\n"
        "    loss scale fell.\n")


def test_a_name_longer_than_the_line_starts_its_own_line_and_stays_whole():
    """Names up to the width stay whole (an indent gives way first); a longer one is printed whole on a line of
    its own under the finding's indent, past the width. It was folded at the 80th column, in the middle of the
    name, which no grep finds, and then put at column 0, where it read as a record of its own."""
    name = "base_model.model.transformer.h.11.mlp.c_fc.lora_dropout.default.very_long_adapter_module_name_here"
    text = render(findings_table([Finding("AMP101", Severity.ERROR, name, "float16.")]), 80, False)
    lines = text.splitlines()
    assert lines[1] == "AMP101 error"
    assert lines[2] == f"    {name}:"
    assert lines[3:] == ["    Trainable float16 parameters under an fp16 GradScaler", "    float16."]


def test_wrapped_names_stay_under_their_findings_indent_at_80_columns():
    """A line at column 0 begins a finding (or the list): a long name wrapped out of a finding's line or detail
    starts under the finding's indent. It was put at column 0, where it read as a record of its own."""
    lora = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.lora_A.default.weight"   # 80 columns
    bert = "bert.encoder.layer.0.attention.output.LayerNorm.weight"
    findings = [Finding("AMP607", Severity.WARNING, lora, "89% of the sampled updates round away.", step=1),
                Finding("AMP101", Severity.ERROR, bert, f"{lora} and {bert} are trainable float16 tensors."),
                Finding("AMP101", Severity.ERROR, f"{bert}.{bert}", "float16.")]   # longer than the line
    lines = render(findings_table(findings), 80, False).splitlines()
    assert f"    {lora}:" in lines and f"    {bert}.{bert}:" in lines
    at_0 = [line for line in lines[1:] if line and not line.startswith(" ")]
    assert at_0 and all(re.match(r"AMP\d{3} (error|warning|info)", line) for line in at_0), at_0


def test_a_name_that_fits_only_without_the_indent_loses_the_indent():
    name = "base_model.model.encoder.layer.0.attention.self.query.lora_A.default.weight"   # 75 columns
    finding = Finding("AMP104", Severity.ERROR, "optimizer[0] group 0", f"the group updates 24 float16 tensors "
                      f"({name}, {name.replace('lora_A', 'lora_B')} and 22 more).")
    lines = render(findings_table([finding]), 80, False).splitlines()
    assert f"   ({name}," in lines and all(len(line) <= 80 for line in lines)   # was folded before its comma


@pytest.mark.parametrize("width", [80, 120])
def test_rules_and_explain_fit_the_width_piped(width):
    rules = render(rules_table(), width, False)
    assert all(len(line) <= width for line in rules.splitlines())
    assert re.search(r"^AMP101 error \S+ fp16-trainable-params: Trainable float16", rules, re.MULTILINE)
    explain = render(rule_panel(get_rule("AMP101")), width, False)
    assert all(len(line) <= width for line in explain.splitlines())
    assert explain.startswith("AMP101 fp16-trainable-params: ") and "│" not in explain
