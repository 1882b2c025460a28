"""The catalog is complete and consistent: codes, checks, error texts and fixes (like flake8's code tests)."""

import ast
import pathlib
import re

import pytest

import ampdoctor.preflight.rules.config  # noqa: F401  (registers checks)
import ampdoctor.preflight.rules.distributed  # noqa: F401
import ampdoctor.preflight.rules.params  # noqa: F401
import ampdoctor.preflight.rules.wiring  # noqa: F401
from ampdoctor.core.catalog import PHASES, RULES, get_rule, rules_for_error, select
from ampdoctor.preflight.rules import CHECKS

TESTS = pathlib.Path(__file__).parents[1]

# Verbatim texts from failures.md §0 (and the rows it points to), with the codes that must explain them.
SECTION_0 = [
    ("ValueError: Attempting to unscale FP16 gradients.", {"AMP101"}),
    ('NotImplementedError: "_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for \'BFloat16\'',
     {"AMP102"}),
    ("RuntimeError: unscale_() has already been called on this optimizer since the last update().",
     {"AMP401", "AMP402"}),
    ("RuntimeError: unscale_() is being called after step().", {"AMP403"}),
    ("RuntimeError: step() has already been called since the last update().", {"AMP404"}),
    ("AssertionError: No inf checks were recorded for this optimizer.", {"AMP406"}),
    ("AssertionError: No inf checks were recorded prior to update.", {"AMP407"}),
    ("AssertionError: Attempted step but _scale is None.  This may indicate your script did not use "
     "scaler.scale(loss or outputs) earlier in the iteration.", {"AMP405"}),
    ("RuntimeError: Closure use is not currently supported if GradScaler is enabled.", {"AMP204"}),
    ("Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.", {"AMP603"}),
    ("RuntimeError: expected scalar type Half but found Float", {"AMP501"}),
    ("RuntimeError: Input type (c10::Half) and bias type (float) should be the same", {"AMP501"}),
    ("RuntimeError: Input type (torch.cuda.HalfTensor) and weight type (torch.cuda.FloatTensor) should be the same",
     {"AMP501"}),
    ("RuntimeError: mat1 and mat2 must have the same dtype, but got Float and Half", {"AMP501"}),
    ("UserWarning: torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.", {"AMP202"}),
    ("UserWarning: You passed `Fabric(accelerator='cpu', precision='16-mixed')` but AMP with fp16 is not supported "
     "on CPU. Using `precision='bf16-mixed'` instead.", {"AMP213"}),
    ("RuntimeError: Could not run 'aten::_amp_foreach_non_finite_check_and_unscale_' with arguments from the "
     "'CPU' backend.", {"AMP206"}),
    ("AssertionError: The growth factor must be > 1.0.", {"AMP207"}),
    ("RuntimeError: The source state dict is empty, possibly because it was saved from a disabled instance of "
     "GradScaler.", {"AMP410"}),
    ("AssertionError: _growth_tracker initialized before _scale", {"AMP405"}),
    ("UserWarning: Detected call of `lr_scheduler.step()` before `optimizer.step()`.", {"AMP409"}),
    ("RuntimeError: The total norm of order 2.0 for gradients from `parameters` is non-finite, so it cannot be "
     "clipped.", {"AMP608"}),
    ("RuntimeError: Function 'SoftmaxBackward0' returned nan values in its 0th output.", {"AMP602"}),   # backward
]

# Texts users pasted into `ampdoctor explain`, each with the one rule whose fix applies.
REPORTED = [
    ('RuntimeError: "addmm_impl_cpu_" not implemented for \'Half\'', {"AMP504"}),
    ('NotImplementedError: "LayerNormKernelImpl" not implemented for \'BFloat16\'', {"AMP504"}),
    ('NotImplementedError: "_amp_foreach_non_finite_check_and_unscale_cpu" not implemented for \'BFloat16\'',
     {"AMP102"}),
    ("RuntimeError: mixed dtype (CPU): expect parameter to have scalar type of Float", {"AMP501"}),
    ("RuntimeError: Function 'MmBackward0' returned nan values in its 0th output.", {"AMP602"}),
    # fairseq's DynamicLossScaler and AMPOptimizer at --min-loss-scale (fairseq/optim/dynamic_loss_scaler.py,
    # amp_optimizer.py at 3d262bb2), and its trainer's log line on a skipped step (fairseq/trainer.py)
    ("FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding. Try lowering the "
     "learning rate, using gradient clipping or increasing the batch size.", {"AMP603"}),
    ("FloatingPointError: AMP: Minimum loss scale reached (0.0001). Your loss is probably exploding.", {"AMP603"}),
    ("fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 64.0", {"AMP604"}),
]


@pytest.mark.parametrize("text,codes", REPORTED, ids=[t[:40] for t, _ in REPORTED])
def test_reported_error_texts_get_the_rule_whose_fix_applies(text, codes):
    assert {r.code for r in rules_for_error(text)} == codes


def test_rule_texts_say_what_the_explanations_say():
    dtype_mismatch, step_twice = get_rule("AMP501"), get_rule("AMP404")
    assert "outside torch.autocast" not in dtype_mismatch.title
    assert "layer_norm" in dtype_mismatch.why and "model.float()" in dtype_mismatch.fix
    assert "update()" in step_twice.title
    code = [line.split("#")[0].strip() for line in step_twice.fix.splitlines()]
    assert code[:3] == ["scaler.scale(loss).backward()", "scaler.step(opt)", "scaler.update()"]


def test_codes_names_and_fields_are_well_formed():
    codes = [r.code for r in RULES]
    names = [r.name for r in RULES]
    assert len(set(codes)) == len(codes) and len(set(names)) == len(names)
    for rule in RULES:
        assert re.fullmatch(r"AMP\d{3}", rule.code), rule.code
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule.name), rule.name
        assert rule.phase in PHASES
        assert rule.title and rule.why and rule.fix, rule.code
        assert get_rule(rule.code) is rule and get_rule(rule.name) is rule


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.code)
def test_every_fix_is_python(rule):
    ast.parse(rule.fix)  # comments and code the user can paste


def test_every_preflight_rule_has_exactly_one_check_and_every_check_a_rule():
    preflight = {r.code for r in RULES if r.phase == "preflight"}
    assert preflight == set(CHECKS)


def test_every_watch_rule_has_exactly_one_emitter_and_every_emitter_only_watch_rules():
    """As the pre-flight's checks: each watch-phase code is emitted by one part of the watch (``monitor.part``,
    its ``codes``), by the invariants (``monitor.verdicts``), or by the clip norms the session records."""
    from ampdoctor.monitor import verdicts
    from ampdoctor.monitor.parts import parts
    from ampdoctor.session import clip_norms

    emitters = {cls.name: cls.codes for cls in parts()} | {"invariants": verdicts.CODES,
                                                           "clip norms": clip_norms.CODES}
    emitted = [code for codes in emitters.values() for code in codes]
    watch = [r.code for r in RULES if r.phase == "watch"]
    assert sorted(emitted) == sorted(watch), {c: [n for n, codes in emitters.items() if c in codes]
                                              for c in set(emitted) | set(watch) if emitted.count(c) != 1}


@pytest.mark.parametrize("text,codes", SECTION_0, ids=[t[:40] for t, _ in SECTION_0])
def test_every_section_0_error_text_is_explained(text, codes):
    assert {r.code for r in rules_for_error(text)} == codes


def test_every_code_is_exercised_by_a_test_outside_this_file():
    corpus = "\n".join(p.read_text(encoding="utf-8") for p in TESTS.rglob("test_*.py") if p.name != "test_catalog.py")
    missing = [r.code for r in RULES if r.code not in corpus]
    assert missing == []


def test_select_by_prefix():
    assert [r.code for r in select(["AMP40"])] == [f"AMP40{i}" for i in range(1, 10)]
    assert select(["XYZ"]) == []
    with pytest.raises(KeyError, match="no rule 'AMP999'"):
        get_rule("AMP999")


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.code)
def test_every_rule_prints_in_80_columns_under_its_indent(rule):
    # `ampdoctor explain CODE` and a report's fixes: code lines are never broken, so the catalog's must fit
    from ampdoctor.ui.console import RuleView

    lines = [line.plain for line in RuleView(rule).lines(80)]
    assert lines[0].startswith(f"{rule.code} {rule.name}")
    assert [line for line in lines if len(line) > 80] == []


def test_a_finding_takes_only_a_severity_its_rule_declares():
    rule = get_rule("AMP612")
    assert rule.finding("loop", "x").severity.value == "warning"
    assert rule.finding("loop", "x", severity=rule.escalates[0][0]).severity.value == "error"
    with pytest.raises(ValueError, match="AMP101 findings are error in the catalog, not warning"):
        get_rule("AMP101").finding("fc", "x", severity=get_rule("AMP103").severity)


COLLAPSE = TESTS / "scripts" / "sqrt_of_zero.py"   # every step skipped: no weight is updated


def test_the_severity_a_run_prints_is_the_one_rules_explain_and_the_docs_state(tmp_path, capsys):
    from ampdoctor.ui.cli import main

    report = tmp_path / "r.json"
    assert main(["run", "--json", str(report), str(COLLAPSE), "12"]) == 0
    capsys.readouterr()
    import json

    amp612 = [f for f in json.loads(report.read_text())["findings"] if f["code"] == "AMP612"]
    assert [f["severity"] for f in amp612] == ["error"]   # every step skipped: no weight was updated
    assert main(["explain", "AMP612"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "severity: warning; error when no optimizer step updated a weight" in said
    assert main(["rules", "--select", "AMP612"]) == 0
    assert "AMP612 warning/error watch no-progress" in capsys.readouterr().out
    assert main(["rules", "--markdown", "--select", "AMP612"]) == 0
    assert "| warning; error when no optimizer step updated a weight" in capsys.readouterr().out
    # the rule pages state the same: tests/docs/test_rule_pages.py reads the built AMP612 page
