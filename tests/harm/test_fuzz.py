"""Do no harm, bad input: `explain` and `report` take any text or file without a traceback from ampdoctor's
internals, exit with 0, 1 or 2 only, never execute or unpickle what they read, and escape what they show in HTML.

Hypothesis example counts are small (the suite stays fast); ``derandomize=True`` keeps every run the same, so a
failure here is reproducible and an expected failure stays one.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import ampdoctor
from ampdoctor.core.catalog import RULES, Rule
from ampdoctor.core.records import SCHEMA as LOG_SCHEMA
from ampdoctor.core.records import read_log
from ampdoctor.core.report import SCHEMA as REPORT_SCHEMA
from ampdoctor.explanations.crash import explain_text
from ampdoctor.ui.cli import main

from .test_identity import one_torch_thread, script_path  # noqa: F401  (autouse fixture)

# function_scoped_fixture: the autouse one_torch_thread fixture is the same for every example
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def run_cli(*argv: str, stdin: bytes | None = None) -> tuple[int, str]:
    """``main(argv)`` with its output captured; an exception escaping main fails the test with its traceback."""
    out = io.StringIO()
    saved = sys.stdin
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(list(argv))
    finally:
        sys.stdin = saved
    text = out.getvalue()
    assert code in (0, 1, 2), (code, text[-2000:])
    assert "Traceback (most recent call last)" not in text, text[-4000:]
    return code, text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# ---- explain ---------------------------------------------------------------------------------------------------

def _error_fragments() -> list[str]:
    """Pieces of the torch error texts the catalog knows, to splice into random text."""
    pieces = []
    for rule in RULES:
        for pattern in rule.errors:
            pieces.append("".join(ch for ch in pattern if ch not in "\\^$?*+()[]{}|"))
    return pieces or ["Attempting to unscale FP16 gradients."]


_TEXT = st.one_of(
    st.text(max_size=2000),
    st.lists(st.one_of(st.sampled_from(_error_fragments()), st.text(max_size=50)), max_size=30).map(" ".join),
    st.lists(st.sampled_from(["Traceback (most recent call last):\n", '  File "x.py", line 1\n', "RuntimeError: ",
                              "\x00", "\udcff", "🔥", "\r\n", "AMP", "AMP1", "AMP999", "a" * 600, ".*" * 50]),
             max_size=40).map("".join),
)


@FUZZ
@given(text=_TEXT)
@example(text="")
@example(text="AMP101")
@example(text="Attempting to unscale FP16 gradients. " * 5000)
@example(text="expected " + "dtype " * 20000 + " to match")
def test_explain_text_returns_rules_for_any_text(text):
    rules = explain_text(text)
    assert isinstance(rules, list) and all(isinstance(r, Rule) for r in rules)


@FUZZ
@given(text=_TEXT)
@example(text="-")
@example(text="--help")
@example(text="-x")
@example(text="\x00")
def test_ampdoctor_explain_exits_0_1_or_2_on_any_text(text):
    if text == "-":  # '-' reads the text from stdin: give it some
        run_cli("explain", "-", stdin=b"ValueError: Attempting to unscale FP16 gradients.\n\xff\xfe")
    else:
        run_cli("explain", text)


def test_ampdoctor_explain_reads_binary_garbage_from_stdin():
    code, _ = run_cli("explain", "-", stdin=os.urandom(4096) + b"Attempting to unscale FP16 gradients.")
    assert code == 0


def test_explain_text_reads_only_the_tail_of_a_huge_adversarial_paste():
    # The work is bounded by what is read (not timed here): an error before the last MAX_TEXT characters is not seen,
    # and every line is cut to _MAX_LINE, so the answer is that of the tail's lines cut.
    from ampdoctor.core.catalog import _MAX_LINE, MAX_TEXT

    junk = ("expected scalar type " + "Half " * 400 + "\n") * 2000  # ~4 MB
    assert len(junk) > 10 * MAX_TEXT and len(junk.splitlines()[0]) > _MAX_LINE
    seed = "ValueError: Attempting to unscale FP16 gradients.\n"
    assert [r.code for r in explain_text(seed)] == ["AMP101"]
    assert explain_text(seed + junk) == explain_text(junk[-MAX_TEXT:])   # the seed, 4 MB back, is past the tail
    assert [r.code for r in explain_text(junk + seed)] == ["AMP101"]   # at the end of the log it is read


# ---- report: files of any shape --------------------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
_KEYS = ["type", "schema", "step", "scale", "gradients", "rows", "global_norm", "lost_updates", "fraction", "findings",
         "code", "severity", "where", "detail", "skipped_total", "grad_columns", "params", "environment", "end"]
_RECORDISH = st.dictionaries(st.sampled_from(_KEYS), _JSON, max_size=8)


def _log(header: Any, lines: list[Any]) -> bytes:
    out = [json.dumps(header)] + [v if isinstance(v, str) else json.dumps(v) for v in lines]
    return "\n".join(out).encode("utf-8", errors="surrogatepass") + b"\n"


_HEADER = st.fixed_dictionaries({"type": st.just("header"), "schema": st.just(LOG_SCHEMA)},
                                optional={"grad_columns": _JSON, "every": _JSON, "params": _JSON,
                                          "environment": _JSON})
_LOG_LINE = st.one_of(
    _RECORDISH.map(lambda d: {**d, "type": "step"}),
    _RECORDISH,
    _JSON,
    st.text(max_size=80),  # garbage, written raw
    st.sampled_from(['{"type":"step","step":NaN,"scale":{"scale":Infinity,"skipped_total":-Infinity}}',
                     '{"type":"step","step":1e999}', '{"type":"step","step":-1,"gradients":{"rows":[[NaN]]}}',
                     "[" * 50 + "]" * 50, '{"type":"header","schema":"x"}', '{"type":"end"}', "null", "\t"]),
)
_FILES = st.one_of(
    st.binary(max_size=3000),
    _JSON.map(lambda v: json.dumps(v).encode()),
    st.builds(_log, _HEADER, st.lists(_LOG_LINE, max_size=12)),
    st.builds(_log, _RECORDISH, st.lists(_LOG_LINE, max_size=6)),  # a foreign or broken header
    st.builds(lambda data, cut: data[:cut], st.builds(_log, _HEADER, st.lists(_LOG_LINE, max_size=6)),
              st.integers(0, 4000)),  # torn anywhere
)


@FUZZ
@given(data=_FILES, suffix=st.sampled_from([".jsonl", ".json", ""]))
@example(data=b"", suffix=".jsonl")
@example(data=b"\xff\xfe\x00garbage", suffix=".json")
@example(data=b"NaN", suffix=".json")
@example(data=b"[1, 2, 3]", suffix=".json")
@example(data=b'"a string"', suffix=".json")
@example(data=b'{"type":"header","schema":"ampdoctor.watch/1"}\n{"type":"step","step":NaN}\n[1]\nnot json\n',
         suffix=".jsonl")
def test_ampdoctor_report_exits_0_1_or_2_on_any_file(data, suffix, workdir):
    path = workdir / f"input{suffix}"
    path.write_bytes(data)
    run_cli("report", str(path))


@FUZZ
@given(data=_FILES)
def test_read_log_returns_or_says_what_is_wrong_for_any_file(data, workdir):
    path = workdir / "any.jsonl"
    path.write_bytes(data)
    header, records, problems = read_log(path)
    assert header is None or isinstance(header, dict)
    assert all(isinstance(r, dict) for r in records) and all(isinstance(p, str) for p in problems)


DEEP = 100_000


@pytest.mark.parametrize("name, content", [
    ("deep.json", "[" * DEEP + "]" * DEEP),
    ("deep-object.json", '{"a":' * DEEP + "1" + "}" * DEEP),
    ("deep.jsonl", '{"type":"header","schema":"ampdoctor.watch/1"}\n' + "[" * DEEP + "]" * DEEP + "\n"),
    ("huge.json", json.dumps({"schema": REPORT_SCHEMA, "findings": [], "environment": {"x": "y" * 1000},
                              "changes": ["z" * 100] * 20_000})),
    ("huge.jsonl", '{"type":"header","schema":"ampdoctor.watch/1"}\n'
     + '{"type":"step","step":0,"gradients":{"rows":[' + ",".join(["[1,2,3]"] * 200_000) + "]}}\n"),
])
def test_ampdoctor_report_survives_deep_and_huge_json(name, content, workdir):
    path = workdir / name
    path.write_text(content)
    run_cli("report", str(path))




@pytest.mark.parametrize("field, value", [
    ("findings", 5),
    ("changes", 5),
    ("exception", "boom"),
    ("environment", "x"),
    ("findings", [{"code": "AMP101", "severity": "error", "where": "x", "detail": "y", "step": {"a": 1}}]),
    ("findings", [{"code": "AMP101", "severity": "fatal", "where": "x", "detail": "y"}]),
    ("findings", {"code": "AMP101"}),
    ("changes", "a string"),
    ("exception", None),
])
def test_ampdoctor_report_on_a_report_with_fields_of_the_wrong_type(field, value, workdir):
    path = workdir / "wrong.json"
    path.write_text(json.dumps({"schema": REPORT_SCHEMA, "findings": [], field: value}))
    run_cli("report", str(path), "--html", str(workdir / "wrong.html"))


def _real_report(workdir: Path) -> dict[str, Any]:
    path = workdir / "real-report.json"
    if not path.exists():
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(["run", "--json", str(path), script_path("amp_loop.py"), str(workdir / "real.pt")])
    return json.loads(path.read_text())


def _mutate(data: Any, path: list[Any], value: Any) -> Any:
    """Replace the value at ``path`` (indices into dicts/lists, taken modulo their size) with ``value``."""
    if not path or not isinstance(data, (dict, list)) or not data:
        return value
    if isinstance(data, dict):
        key = sorted(data)[path[0] % len(data)]
        return {**data, key: _mutate(data[key], path[1:], value)}
    i = path[0] % len(data)
    return data[:i] + [_mutate(data[i], path[1:], value)] + data[i + 1:]


@FUZZ
@given(path=st.lists(st.integers(0, 50), min_size=1, max_size=4), value=_JSON)
@example(path=[3], value=5)  # sorted keys: changes, environment, exception, findings, ... -> findings
def test_ampdoctor_report_on_a_mutated_real_report(path, value, workdir):
    data = _mutate(_real_report(workdir), path, value)
    data["schema"] = REPORT_SCHEMA
    target = workdir / "mutated.json"
    target.write_text(json.dumps(data))
    run_cli("report", str(target))


# ---- report: hostile names are escaped in HTML ------------------------------------------------------------------

HOSTILE = ["<script>alert(1)</script>", "x<img src=x onerror=alert(1)>"]


class Hostile(nn.Module):
    """A model whose modules have names that are HTML; torch forbids only '.' and '' in module names."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module(HOSTILE[0], nn.Linear(4, 8))
        self.add_module(HOSTILE[1], nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, HOSTILE[1])(torch.relu(getattr(self, HOSTILE[0])(x)))


def _raw_hostile(html_text: str) -> list[str]:
    """Markup from the names that would be live: an unescaped '<script' or '<img src=x' (escaped text is harmless;
    the report's own plots are <img alt=...>)."""
    return [h for h in HOSTILE if h in html_text] + [t for t in ("<script", "<img src=x") if t in html_text.lower()]


def test_torch_accepts_html_as_module_names():
    model = Hostile()
    assert [n for n, _ in model.named_modules()][1:] == HOSTILE


def test_report_html_escapes_module_names_from_a_flight_recorder(workdir):
    torch.manual_seed(0)
    model = Hostile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    log_dir = workdir / "hostile-log"
    with ampdoctor.watch(model, opt, scaler, every=1, activations=True, log_dir=str(log_dir)) as w:
        for step in range(3):
            x = torch.randn(8, 4) * (1e6 if step == 1 else 1.0)  # step 1 overflows fp16 inside HOSTILE[0]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert any(HOSTILE[0] in f.where for f in w.findings())  # the name is really in what was recorded
    assert HOSTILE[0] in (log_dir / "ampdoctor.jsonl").read_text()
    out = workdir / "hostile-log.html"
    run_cli("report", str(log_dir / "ampdoctor.jsonl"), "--html", str(out))
    assert _raw_hostile(out.read_text(encoding="utf-8")) == []


def test_report_html_escapes_module_names_from_a_json_report(workdir):
    script = workdir / "hostile_script.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        f"names = {HOSTILE!r}\n"
        "model = nn.Sequential()\nmodel.add_module(names[0], nn.Linear(4, 8))\nmodel.add_module(names[1], "
        "nn.Linear(8, 1))\nmodel.half()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nscaler = torch.amp.GradScaler('cpu')\n"
        "with torch.autocast('cpu', dtype=torch.float16):\n    loss = model(torch.randn(2, 4)).float().sum()\n"
        "scaler.scale(loss).backward()\nscaler.step(opt)\n")
    report_path = workdir / "hostile-report.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["run", "--json", str(report_path), str(script)])
    assert code == 1  # "Attempting to unscale FP16 gradients", explained with the hostile names
    report = json.loads(report_path.read_text())
    assert any(HOSTILE[0] in f["where"] + f["detail"] for f in report["findings"])
    out = workdir / "hostile-report.html"
    run_cli("report", str(report_path), "--html", str(out))
    html_text = out.read_text(encoding="utf-8")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html_text  # shown, escaped
    assert _raw_hostile(html_text) == []


# ---- report: nothing read is ever executed ----------------------------------------------------------------------

class _Payload:
    """Unpickling this creates the file ``target``: a stand-in for any code a pickle could run."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (Path.touch, (self.target,))


def _payload_files(workdir: Path, sentinel: Path) -> list[Path]:
    files = []
    raw = pickle.dumps(_Payload(sentinel), protocol=4)
    for name in ("pickle.jsonl", "pickle.json", "pickle.pt"):
        files.append(workdir / name)
        files[-1].write_bytes(raw)
    files.append(workdir / "torch-save.jsonl")
    torch.save({"payload": _Payload(sentinel)}, files[-1])
    header = json.dumps({"type": "header", "schema": LOG_SCHEMA})
    lines = [
        json.dumps({"type": "step", "step": 0, "py/reduce": [{"py/function": "pathlib.Path.touch"},
                                                             {"py/tuple": [str(sentinel)]}]}),
        json.dumps({"type": "step", "step": 1, "__reduce__": ["pathlib.Path.touch", [str(sentinel)]],
                    "py/object": "os.system"}),
        f"!!python/object/apply:pathlib.Path.touch [{json.dumps(str(sentinel))}]",
        raw.decode("latin-1"),
    ]
    files.append(workdir / "reduce.jsonl")
    files[-1].write_text("\n".join([header] + lines) + "\n", encoding="utf-8")
    files.append(workdir / "reduce.json")
    files[-1].write_text(json.dumps({"schema": REPORT_SCHEMA, "findings": [], "environment": {
        "__reduce__": ["pathlib.Path.touch", [str(sentinel)]], "py/object": "os.system"},
        "exception": {"type": "!!python/object/apply:os.system", "message": "x"}}))
    return files


def test_the_payload_would_run_if_unpickled(workdir):
    """The check below can fail: unpickling the payload does create the file."""
    sentinel = workdir / "proof"
    pickle.loads(pickle.dumps(_Payload(sentinel)))
    assert sentinel.exists()


def test_loading_a_log_or_report_never_unpickles_or_executes_anything(workdir):
    sentinel = workdir / "executed"
    for path in _payload_files(workdir, sentinel):
        run_cli("report", str(path))
        run_cli("report", str(path), "--html", str(workdir / "payload.html"))
        if path.suffix == ".jsonl":
            read_log(path)
        assert not sentinel.exists(), f"reading {path.name} executed the payload"
    run_cli("explain", f"!!python/object/apply:pathlib.Path.touch [{json.dumps(str(sentinel))}]")
    assert not sentinel.exists()


def test_nan_and_infinity_in_a_log_are_just_numbers(workdir):
    path = workdir / "nonfinite.jsonl"
    path.write_text('{"type":"header","schema":"ampdoctor.watch/1","grad_columns":["has_grad"]}\n'
                    '{"type":"step","step":0,"scale":{"scale":NaN,"skipped_total":Infinity},'
                    '"gradients":{"global_norm":-Infinity,"rows":[[NaN]]}}\n'
                    '{"type":"step","step":1,"scale":{"scale":65536.0},"gradients":{"global_norm":1.5}}\n')
    header, records, problems = read_log(path)
    assert problems == [] and math.isnan(records[0]["scale"]["scale"])
    code, text = run_cli("report", str(path), "--html", str(workdir / "nonfinite.html"))
    assert code in (0, 1) and "last completed sampled step: 1" in text
