"""A watch's host reads: every one goes through ``core.host_reads`` and counts in ``Watch.host_syncs``.

A sampled step costs one copy (gradients, loss scale, lost updates) plus one read of the activation monitor when it
is on; a step that is not sampled costs none.
"""

from __future__ import annotations

import torch
from torch import nn

import ampdoctor
from ampdoctor.core.host_reads import HostReads, process_reads
from ampdoctor.monitor.host_sync import HostCopy


def _steps(activations: bool, steps: int = 7,
           every: int = 3) -> tuple[list[int], list[dict[str, int]], ampdoctor.Watch]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)   # small: no step overflows, so nothing escalates
    w = ampdoctor.watch(model, opt, scaler, every=every, dense=0, activations=activations)
    per_step, by_owner = [], []
    for _ in range(steps):
        before, owners = w.host_syncs, process_reads()
        loss = model(torch.randn(2, 4)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        per_step.append(w.host_syncs - before)
        after = process_reads()
        by_owner.append({k: n - owners.get(k, 0) for k, n in after.items() if n != owners.get(k, 0)})
    w.detach()
    return per_step, by_owner, w


def test_a_watched_run_reads_once_per_sampled_step_and_never_on_other_steps():
    per_step, by_owner, w = _steps(activations=False)
    assert w.summary_data()["scale"]["skipped"] == 0
    assert per_step == [1, 0, 0, 1, 0, 0, 1]   # steps 0, 3 and 6 are sampled (every=3)
    assert by_owner == [{"watch": 1}, {}, {}, {"watch": 1}, {}, {}, {"watch": 1}]   # nothing read elsewhere
    assert w.host_syncs == w.summary_data()["host_syncs"] == 3


def test_the_activation_monitor_s_values_travel_in_the_sampled_step_s_one_read():
    per_step, by_owner, w = _steps(activations=True)
    assert per_step == [1, 0, 0, 1, 0, 0, 1]
    assert by_owner[0] == {"watch": 1} and by_owner[1] == {}
    assert w.host_syncs == 3
    assert w.summary_data()["activations"]["sampled_steps"] == 3  # read, from the watch's copy


def test_a_copy_counts_one_read_for_its_owner_and_an_empty_one_none():
    reads = HostReads("watch")
    HostCopy({"a": {}}, reads).values()
    assert reads.count == 0
    assert HostCopy({"a": {"x": torch.ones(3)}, "b": {"y": torch.zeros(1)}}, reads).values() == {
        "a": {"x": [1.0, 1.0, 1.0]}, "b": {"y": [0.0]}}
    assert reads.count == 1
