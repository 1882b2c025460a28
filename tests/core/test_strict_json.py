"""core/strict_json.py: inf and NaN written as strings a strict parser reads, and read back as floats."""

from __future__ import annotations

import json
import math

import pytest
import torch
from strict_json_check import strict_loads

from ampdoctor.core.strict_json import json_text, nonfinite_float


def test_inf_and_nan_are_written_as_strings_wherever_they_are():
    data = {"loss": math.nan, "norms": (1.5, math.inf, -math.inf), "nested": [{"absmax": math.nan}],
            "tensor": torch.tensor([1.0, math.inf]), "one": torch.tensor(math.nan), math.inf: "a key"}
    for options in ({}, {"indent": 2}, {"separators": (",", ":")}):
        read = strict_loads(json_text(data, **options))
        assert read == {"loss": "nan", "norms": [1.5, "inf", "-inf"], "nested": [{"absmax": "nan"}],
                        "tensor": [1.0, "inf"], "one": "nan", "inf": "a key"}
    assert [nonfinite_float(v) for v in read["norms"]] == [None, math.inf, -math.inf]
    assert math.isnan(nonfinite_float(read["loss"]))


def test_finite_data_is_written_as_json_writes_it():
    data = {"scale": 65536.0, "steps": [0, 1], "dtype": torch.float16, "ok": True, "none": None}
    assert json_text(data, indent=2) == json.dumps({**data, "dtype": "torch.float16"}, indent=2)


@pytest.mark.parametrize("text", ["Infinity", "NaN", "INF", " inf", "nan!", ""])
def test_only_the_three_strings_read_as_floats(text):
    assert nonfinite_float(text) is None
