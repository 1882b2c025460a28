"""Unknown error texts: a clear 'unknown' answer, with the closest rule family only when the text reads like one."""

from __future__ import annotations

import pytest

from ampdoctor.explanations.crash import closest_family, explain_text, unknown_answer
from ampdoctor.explanations.families import FAMILIES


@pytest.mark.parametrize("text, prefix", [
    ("RuntimeError: expected tensor of dtype BFloat16 but got Half", "AMP5"),
    ("RuntimeError: Half and BFloat16 inputs do not match in my_custom_op", "AMP5"),
    ("RuntimeError: GradScaler.step() was called in the wrong state", "AMP4"),
    ("ValueError: loss is nan at step 120", "AMP6"),
    ("ValueError: autocast is not supported on device 'xpu'", "AMP2"),
    ('Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
     "RuntimeError: my_kernel: bfloat16 not supported", "AMP5"),
])
def test_an_unmatched_text_of_a_family_names_the_family(text, prefix):
    assert explain_text(text) == []   # no rule explains it
    family = closest_family(text)
    assert family is not None and family.prefix == prefix
    answer = unknown_answer(text)
    assert answer.startswith("unknown error")
    assert f"closest family: {family.title} ({prefix}xx)" in answer
    # the family is named, not listed: its size and the command that lists it
    assert f"lists the family's {len(family.codes)} rules" in answer
    assert sum(code in answer for code in family.codes) <= 3


@pytest.mark.parametrize("text", [
    "KeyError: 'foo'",
    "OverflowError: int too large to convert to float",
    "RuntimeError: expected scalar type Long but found Int",   # a dtype error, but no half dtype
    "CUDA out of memory. Tried to allocate 2.00 GiB",
    "",
])
def test_an_unrelated_text_is_unknown_without_a_family(text):
    assert explain_text(text) == []
    assert closest_family(text) is None
    answer = unknown_answer(text)
    assert answer.startswith("unknown error") and "closest family" not in answer


def test_the_error_line_decides_not_the_log_above_it():
    log = "step 1 loss nan\n" + "RuntimeError: expected tensor of dtype BFloat16 but got Half\n"
    assert closest_family(log).prefix == "AMP5"


def test_every_family_has_rules():
    assert all(family.codes for family in FAMILIES)
    assert closest_family("step ok\n" * 100_000 + "bf16 mismatch").prefix == "AMP5"   # the tail is read
