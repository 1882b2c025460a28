"""``%load_ext ampdoctor`` in real notebooks, executed in a real ipykernel by nbclient (no browser)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

# The kernel imports the ampdoctor this test process imports (``PYTHONPATH=src``: this checkout's; another
# PYTHONPATH runs the same notebooks against other code, such as the code before a change).
SRC = str(Path(importlib.util.find_spec("ampdoctor").origin).parents[1])

MODEL = """\
import collections, hashlib, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(collections.OrderedDict(
    encoder=nn.Linear(8, 16), act=nn.ReLU(), head=nn.Linear(16, 2)))
x, y = torch.randn(32, 8), torch.randn(32, 2)
"""

SEED_ERROR = MODEL + """\
model = model.half()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
with torch.autocast("cpu", dtype=torch.float16):
    loss = (model(x.half()).float() - y).pow(2).mean()
scaler.scale(loss).backward()
scaler.step(opt)
"""

OPTIMIZER_CELL = """\
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""


def scaled_steps(steps: int) -> str:
    """A training cell: ``steps`` fp16-autocast steps through the notebook's ``scaler``."""
    return f"""\
for _ in range({steps}):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(x).float() - y).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("trained", torch.isfinite(loss).item())
"""


FIXED = "model.float()\n" + OPTIMIZER_CELL + scaled_steps(5)

FP32_TRAINING = MODEL + """\
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(20):
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    opt.step()
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(weights).hexdigest())
"""

HOOKS = """\
import torch.optim.optimizer as o
from torch.nn.modules import module as m
print("hooks", len(m._global_forward_pre_hooks), len(m._global_forward_hooks), len(m._global_backward_hooks),
      len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks),
      any("__ampdoctor_observer__" in dir(v) for v in vars(torch.amp.GradScaler).values()),
      "__ampdoctor_observer__" in dir(torch.optim.Optimizer.__init__))
"""


def run_notebook(*cells: str, tmp_path: Path) -> list[list[dict]]:
    """Execute ``cells`` in a fresh python3 kernel that imports ampdoctor from this checkout; return each cell's
    outputs (a cell may raise: the next cells still run, as in a notebook)."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=240, allow_errors=True,
                                     resources={"metadata": {"path": str(tmp_path)}})
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = SRC + (os.pathsep + saved if saved else "")
    try:
        client.execute()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
    return [cell.outputs for cell in nb.cells]


def text(outputs: list[dict]) -> str:
    """A cell's outputs as one text, in order: streams, results and tracebacks (colours removed)."""
    import re

    parts = []
    for out in outputs:
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] == "error":
            parts.append("\n".join(out["traceback"]) + "\n")
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return re.sub(r"\x1b\[[0-9;]*m", "", "".join(parts))


def test_seed_error_in_a_cell_is_explained_under_its_traceback_and_the_fixed_cell_trains(tmp_path):
    load, crash, fixed = run_notebook("%load_ext ampdoctor", SEED_ERROR, FIXED, tmp_path=tmp_path)
    assert text(load) == ""
    kinds = [o["output_type"] for o in crash]
    assert "error" in kinds and crash[kinds.index("error")]["evalue"] == "Attempting to unscale FP16 gradients."
    after = text(crash[kinds.index("error") + 1:])   # what follows IPython's own traceback
    assert "AMP101" in after and "encoder" in after and "head" in after
    assert "upcast_trainable_params_" in after   # the fix, as code
    assert [o["output_type"] for o in fixed] == ["stream"] and "trained True" in text(fixed)


def test_magic_shows_the_watch_summary_of_the_training_so_far(tmp_path):
    _, train, magic = run_notebook("%load_ext ampdoctor", FP32_TRAINING, "%ampdoctor", tmp_path=tmp_path)
    assert "weights" in text(train)
    shown = text(magic)
    assert "ampdoctor watch: 20 steps" in shown


def test_magic_after_the_fixed_cell_shows_its_training(tmp_path):
    _, _, fixed, magic = run_notebook("%load_ext ampdoctor", SEED_ERROR, FIXED, "%ampdoctor", tmp_path=tmp_path)
    assert "trained True" in text(fixed)
    assert "ampdoctor watch: 5 steps" in text(magic)   # the fixed cell's stage, the crashed one's AMP101 once
    assert text(magic).count("AMP101 error") == 1


def test_fp32_notebook_trains_bitwise_the_same_with_the_extension_and_is_not_called_unhealthy(tmp_path):
    (plain,) = run_notebook(FP32_TRAINING, tmp_path=tmp_path)
    _, watched, magic = run_notebook("%load_ext ampdoctor", FP32_TRAINING, "%ampdoctor", tmp_path=tmp_path)
    digest = [line for line in text(plain).splitlines() if line.startswith("weights ")]
    assert digest and digest == [line for line in text(watched).splitlines() if line.startswith("weights ")]
    shown = text(magic)
    assert "ampdoctor watch:" in shown and "AMP" not in shown.replace("ampdoctor", "")   # no finding at all
    assert "error" not in shown and "warning" not in shown


def test_unload_leaves_no_hook_behind(tmp_path):
    before, _, _, _, during, _, after = run_notebook("import torch\n" + HOOKS, "%load_ext ampdoctor", SEED_ERROR,
                                                     FIXED, HOOKS, "%unload_ext ampdoctor", HOOKS, tmp_path=tmp_path)
    assert "hooks 0 0 0 0 0 False False" in text(before)
    # loaded: the optimizer step hooks (the pre-hook, and the post-hook of the watch's backward monitor: another
    # optimizer's step uses a backward), GradScaler's observers and Optimizer.__init__'s (a cell built a new one)
    assert "hooks 0 0 0 1 1 True True" in text(during)
    assert "hooks 0 0 0 0 0 False False" in text(after)


def test_fix_on_repairs_the_following_cells(tmp_path):
    _, switched, crash = run_notebook("%load_ext ampdoctor", "%ampdoctor --fix", SEED_ERROR + "print('stepped')",
                                      tmp_path=tmp_path)
    assert "--fix is on" in text(switched)
    assert [o["output_type"] for o in crash] != [] and "error" not in [o["output_type"] for o in crash]
    assert "stepped" in text(crash)


AMP_TRAINING = MODEL + OPTIMIZER_CELL

NO_SCALER_STEPS = """\
for _ in range(6):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(x).float() - y).pow(2).mean()
    loss.backward()
    opt.step()
print("loss", round(loss.item(), 4))
"""


def finding_rows(shown: str, code: str) -> int:
    """How many rows of a findings table name ``code`` (a row starts with the code and its severity)."""
    return sum(line.startswith(f"{code} error") or line.startswith(f"{code} warning") for line in shown.splitlines())


def test_re_running_the_model_cell_is_a_new_stage_with_one_set_of_findings(tmp_path):
    # what people do: run the model cell and the training cell, change something, run both again. IPython keeps the
    # crashed cell's traceback (sys.last_traceback), and with it the crashed cell's optimizer, scaler and model.
    cells = run_notebook("%load_ext ampdoctor", SEED_ERROR, SEED_ERROR, AMP_TRAINING, NO_SCALER_STEPS, AMP_TRAINING,
                         NO_SCALER_STEPS, "%ampdoctor", tmp_path=tmp_path)
    first, again, magic = text(cells[1]), text(cells[2]), text(cells[-1])
    assert "AMP101" in first and "AMP101" in again   # each crash is explained under its own traceback
    assert finding_rows(magic, "AMP101") == 1 and finding_rows(magic, "AMP208") == 1   # reported once each
    # the AMP101 of the current model only: no second model (model[1].encoder, model.encoder, Sequential.encoder)
    assert "    encoder" in magic and ".encoder" not in magic and "[1]" not in magic
    assert "ampdoctor watch: 6 steps" in magic   # the watch follows the re-run cell's optimizer from its first step
    assert "not watched" not in magic


def test_a_re_run_cell_that_repeats_its_crash_says_so_in_one_line(tmp_path):
    _, crash, again, magic = run_notebook("%load_ext ampdoctor", SEED_ERROR, SEED_ERROR, "%ampdoctor",
                                          tmp_path=tmp_path)
    assert finding_rows(text(crash), "AMP101") == 1 and "upcast_trainable_params_" in text(crash)
    assert any(o["output_type"] == "error" for o in again)   # IPython's traceback, as the first time
    assert "ampdoctor: AMP101 again, as explained above" in text(again)
    assert finding_rows(text(again), "AMP101") == 0 and "upcast_trainable_params_" not in text(again)
    assert finding_rows(text(magic), "AMP101") == 1 and "[1]" not in text(magic)


SCALER_CELL = MODEL + """\
scaler = torch.amp.GradScaler("cpu")
"""

SCALED_STEPS = scaled_steps(3)


def test_a_re_run_optimizer_cell_trains_with_the_earlier_cells_scaler_and_is_not_amp208(tmp_path):
    # the scaler's cell runs once; the optimizer's cell and the training cell run twice: the second stage's forward
    # comes before its scaler.scale(), and the scaler belongs to the ended stage until then
    cells = run_notebook("%load_ext ampdoctor", SCALER_CELL, OPTIMIZER_CELL, SCALED_STEPS, OPTIMIZER_CELL,
                         SCALED_STEPS, "%ampdoctor", tmp_path=tmp_path)
    assert "trained True" in text(cells[5])
    magic = text(cells[-1])
    assert "ampdoctor watch: 3 steps" in magic and "AMP" not in magic.replace("ampdoctor", "")


TRAINER = """\
import collections, torch
from torch import nn


class Trainer:
    def __init__(self, half):
        torch.manual_seed(0)
        self.model = nn.Sequential(collections.OrderedDict(
            encoder=nn.Linear(8, 16), act=nn.ReLU(), head=nn.Linear(16, 2)))
        if half:
            self.model.half()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scaler = torch.amp.GradScaler("cpu")
        self.x, self.y = torch.randn(32, 8), torch.randn(32, 2)

    def fit(self, steps):
        dtype = next(self.model.parameters()).dtype
        for _ in range(steps):
            self.opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (self.model(self.x.to(dtype)).float() - self.y).pow(2).mean()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        print("trained", torch.isfinite(loss).item())
"""


def test_a_trainer_built_again_in_its_cell_is_a_new_stage_and_the_old_one_is_not_named(tmp_path):
    # The model and optimizer are a Trainer's attributes, not the notebook's names; the crashed fit() frame in
    # IPython's last traceback keeps the crashed Trainer (self) alive.
    cells = run_notebook("%load_ext ampdoctor", TRAINER,
                         "trainer = Trainer(half=True)", "trainer.fit(2)", "trainer = Trainer(half=True)",
                         "trainer.fit(2)", "trainer = Trainer(half=False)", "trainer.fit(5)",
                         "trainer = Trainer(half=False)", "trainer.fit(3)", "%ampdoctor", tmp_path=tmp_path)
    crash, again, trained, magic = text(cells[3]), text(cells[5]), text(cells[9]), text(cells[-1])
    assert finding_rows(crash, "AMP101") == 1 and "AMP101 again, as explained above" in again
    assert "trained True" in trained
    assert finding_rows(magic, "AMP101") == 1 and "    encoder" in magic
    assert ".encoder" not in magic and "[1]" not in magic   # the earlier Trainers' models are not named
    assert "ampdoctor watch: 3 steps" in magic   # the last Trainer's optimizer, from its first step
    assert "not watched" not in magic and "AMP612" not in magic


def test_magic_output_is_rich_html_in_a_kernel_and_html_shows_the_report_inline(tmp_path):
    _, _, magic, page, bad = run_notebook("%load_ext ampdoctor", SEED_ERROR, "%ampdoctor", "%ampdoctor --html",
                                          "%ampdoctor --htm", tmp_path=tmp_path)
    data = [o["data"] for o in magic if o["output_type"] == "display_data"]
    assert data and all("text/html" in d and "text/plain" in d for d in data)
    assert "AMP101" in "".join(d["text/html"] for d in data) and "AMP101 error" in text(magic)
    (frame,) = [o["data"]["text/html"] for o in page if o["output_type"] == "display_data"]
    assert frame.startswith("<iframe srcdoc=") and "AMP101" in frame and "&lt;html" in frame.lower()
    assert "usage: %ampdoctor [--html | --fix | fix on]" in text(bad)


def test_attach_in_a_cell_does_nothing_while_the_extension_is_loaded(tmp_path):
    _, attached, crash, magic = run_notebook(
        "%load_ext ampdoctor", "import ampdoctor\nrun = ampdoctor.attach()\nprint('watched by', run.watched_by)",
        SEED_ERROR, "%ampdoctor", tmp_path=tmp_path)
    assert "watched by the notebook extension" in text(attached)
    assert text(crash).count("AMP101 error") == 1 and text(magic).count("AMP101 error") == 1
