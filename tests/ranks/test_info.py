"""Which rank and node a process is, from the variables its launcher really sets.

``TORCHRUN_NODE_1`` is what torchrun (torch 2.x) gave the worker of ``--nnodes=2 --node-rank=1 --nproc-per-node=1``
(two agents on one machine, its error-file path left out); ``RAY_NODE_1`` is what Ray Train's ``TorchTrainer``
sets on a worker of the second of two nodes with two workers each (``ray/train/torch/config.py``,
``_set_torch_distributed_env_vars``, and ``MASTER_ADDR``/``MASTER_PORT`` for ``init_method="env"``).
"""

from __future__ import annotations

import tempfile

import pytest

from ampdoctor.ranks import exchange as rank_exchange
from ampdoctor.ranks.exchange import RankExchange
from ampdoctor.ranks.info import from_environment

TORCHRUN_NODE_1 = {
    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29731", "RANK": "1", "ROLE_RANK": "1",
    "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "TORCHELASTIC_USE_AGENT_STORE": "True",
    "WORLD_SIZE": "2"}
RAY_NODE_1 = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1", "RANK": "3", "WORLD_SIZE": "4",
              "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "41231"}
LAUNCH = {*TORCHRUN_NODE_1, *RAY_NODE_1, "TORCHELASTIC_ERROR_FILE", rank_exchange.ENV_DIR}


@pytest.fixture
def launched(monkeypatch):
    """Set a launcher's variables in this process's environment, and none of another launch's."""
    def launch(variables: dict[str, str]) -> None:
        for name in LAUNCH:
            monkeypatch.delenv(name, raising=False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
    return launch


def test_rank_from_the_launchers_environment() -> None:
    info = from_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                             "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                             "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (info.rank, info.world_size, info.local_rank, info.node) == (1, 2, 1, 0)
    assert info.job == "127.0.0.1-29500-abc-2"   # a restart meets in a new folder
    assert from_environment({"RANK": "0", "WORLD_SIZE": "1"}) is None
    assert from_environment({"RANK": "2", "WORLD_SIZE": "2"}) is None
    assert from_environment({"RANK": "1", "WORLD_SIZE": "2"}).job is None   # no launcher: no folder to meet in


def test_the_node_is_torchrun_s_group_rank(launched):
    launched(TORCHRUN_NODE_1)
    info = from_environment()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.node) == (1, 2, 0, 1, 1)
    assert info.job == "127.0.0.1-29731-none-0"


def test_the_node_is_ray_train_s_node_rank(launched):
    launched(RAY_NODE_1)
    info = from_environment()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.node) == (3, 4, 1, 2, 1)
    assert info.job == "10.0.0.1-41231--0"


def test_torchrun_s_group_rank_wins_over_a_node_rank_the_job_script_exported(launched):
    launched({**TORCHRUN_NODE_1, "NODE_RANK": "0"})   # a rendezvous may number the nodes otherwise than the script
    assert from_environment().node == 1
    launched({**RAY_NODE_1, "NODE_RANK": "x"})
    assert from_environment().node is None


def test_on_ray_without_a_shared_folder_rank_0_s_node_collects_and_the_second_node_does_not(launched, monkeypatch,
                                                                                              tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # the exchange's private folder: in the temp dir
    launched(RAY_NODE_1)
    second = RankExchange(from_environment())
    launched({**RAY_NODE_1, "RANK": "0", "LOCAL_RANK": "0", "NODE_RANK": "0"})
    first = RankExchange(from_environment())
    assert first.node_only and second.node_only   # a folder on one machine: only rank 0's node meets in it
    assert first.collects and not second.collects
