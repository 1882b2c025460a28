"""The one counter of device-to-host reads, and a check over the AST that the package reads only through it.

``.tolist()``, ``.item()``, ``.cpu()`` and ``.numpy()`` copy a tensor to the host; outside ``core/host_reads.py``
each call is listed below with the reason it is not a device read (or why it stays). ``float(t)``/``bool(t)`` of a
tensor cannot be told from ``float(x)`` in the AST; those were replaced by ``to_host`` where the tensor can be on a
device (the guard's clip norm and step count, the crash explanation's gradient flags).
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import torch

from ampdoctor.core.host_reads import HostReads, process_reads, to_host

SRC = Path(__file__).resolve().parents[2] / "src" / "ampdoctor"
READS = {"tolist", "item", "cpu", "numpy"}
# (module, the call as the check names it) -> why it is no device read, or why it stays.
NOT_DEVICE_READS = {
    ("monitor/host_sync.py", "self._host.tolist()"):
        "host memory (pinned on CUDA): HostCopy counts its one read when the copy starts",
    ("core/formats.py", "torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(0.0)).item()"):
        "a constant computed on CPU tensors built from a Python float",
    ("preflight/rules/params.py", "torch.tensor(eps, dtype=dtype).item()"):
        "a CPU tensor built from a Python float: eps rounded to a half dtype",
    ("core/strict_json.py", "value.tolist()"):
        "the JSON writer's fallback for values json cannot write; the monitors hand the recorder host values",
    ("_compat/engines.py", "value.item()"):
        "an engine's loss scale, read once when the engine is described before training; _compat may import "
        "nothing of ours but _torch, so it cannot reach the counter",
}


def device_reads(source: str) -> list[str]:
    """Return the calls of ``.tolist()``, ``.item()``, ``.cpu()``, ``.numpy()`` in ``source``."""
    return [ast.unparse(node) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr in READS and not node.args]


def test_every_host_read_of_the_package_goes_through_the_counter():
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        name = str(path.relative_to(SRC))
        if name == "core/host_reads.py":
            continue
        calls = [c for c in device_reads(path.read_text(encoding="utf-8")) if (name, c) not in NOT_DEVICE_READS]
        if calls:
            found[name] = calls
    assert found == {}


def test_every_listed_read_is_still_there():
    for (name, call), reason in NOT_DEVICE_READS.items():
        assert reason and call in device_reads((SRC / name).read_text(encoding="utf-8")), \
            f"{name} no longer calls {call}; take it off NOT_DEVICE_READS"


def test_the_check_finds_a_read_added_to_a_copy_of_a_module():
    source = (SRC / "monitor" / "updates.py").read_text(encoding="utf-8")
    assert device_reads(source) == []
    assert device_reads(source + "\ndef peek(t):\n    return t.abs().max().item()\n") == ["t.abs().max().item()"]


def test_a_read_counts_for_its_owner_the_owners_it_is_within_and_the_process_totals():
    watch = HostReads("test watch")
    part = HostReads("test part", within=watch)
    before = process_reads()
    assert to_host(torch.tensor([[1, 2]]), part) == [[1, 2]] and to_host(torch.tensor(True), part) is True
    part.add(3)
    assert (part.count, watch.count) == (5, 5)
    after = process_reads()
    assert after["test part"] - before.get("test part", 0) == 5 and after.get("test watch", 0) == before.get(
        "test watch", 0)   # the totals count each read once, under the owner that made it
    assert to_host(torch.tensor(0.5), "test named") == 0.5 and process_reads()["test named"] >= 1


def test_reads_from_several_threads_are_all_counted():
    reads = HostReads("test threads")
    threads = [threading.Thread(target=lambda: [to_host(torch.ones(1), reads) for _ in range(200)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reads.count == 800
