"""Which rank of a distributed job this process is: from the launcher's environment, or from torch.distributed.

torchrun (``python -m torch.distributed.run``) and ``accelerate launch`` on GPUs (which calls torchrun) give each
worker ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node), ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT``, but no ``NODE_RANK``. Ray Train's
``TorchTrainer`` gives ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT`` (its XLA backend ``GROUP_RANK`` instead); Lightning's launcher and accelerate's
``notebook_launcher`` set or read ``NODE_RANK`` too. So the node is ``GROUP_RANK``, which torchrun's rendezvous
assigned (a ``NODE_RANK`` the job script exported may differ from it), else ``NODE_RANK``. A process group created
by hand (``init_process_group(rank=..., world_size=...)``) has no such variables; its rank is read from
torch.distributed while the group exists. Reading a rank is local: no collective is ever started here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RankInfo", "from_environment", "from_process_group", "launch_job"]


@dataclass(frozen=True)
class RankInfo:
    """This process's place in a distributed job of more than one process.

    Attributes:
        rank: the global rank, ``0 <= rank < world_size``.
        world_size: how many processes the job has (more than one).
        local_rank: the rank on this node, or ``None`` when unknown.
        local_world_size: how many ranks run on this node, or ``None`` when unknown.
        node: the node's rank (torchrun's ``GROUP_RANK``, else ``NODE_RANK``: Ray Train's), or ``None`` when unknown.
        job: what the ranks of one launch share and another launch does not (the rendezvous address, port, run id
            and restart attempt), or ``None`` when the launcher set none of them (a group created by hand).
    """

    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    node: int | None = None
    job: str | None = None

    @property
    def label(self) -> str:
        return f"rank {self.rank}"


def from_environment(environ: Mapping[str, str] | None = None) -> RankInfo | None:
    """Return this process's rank from the variables torchrun sets, or ``None`` outside a job of several processes.

    >>> from_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
    ...                   "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}).job
    '127.0.0.1-29500-none-0'
    >>> from_environment({"RANK": "0", "WORLD_SIZE": "1"}) is None
    True
    """
    env = os.environ if environ is None else environ
    rank, world = _int(env.get("RANK")), _int(env.get("WORLD_SIZE"))
    if rank is None or world is None or world < 2 or not 0 <= rank < world:
        return None
    node = _int(env.get("GROUP_RANK"))
    return RankInfo(rank, world, _int(env.get("LOCAL_RANK")), _int(env.get("LOCAL_WORLD_SIZE")),
                    _int(env.get("NODE_RANK")) if node is None else node, launch_job(env))


def launch_job(environ: Mapping[str, str] | None = None) -> str | None:
    """Return what names this launch for all its ranks (``RankInfo.job``), or ``None`` when nothing does.

    Read alone for the launchers that set ``MASTER_ADDR``/``MASTER_PORT`` but not ``RANK`` (Lightning's
    ``ddp_spawn``, whose rank comes from the process group).

    >>> launch_job({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}), launch_job({})
    ('127.0.0.1-29500--0', None)
    """
    env = os.environ if environ is None else environ
    parts = [env.get("MASTER_ADDR"), env.get("MASTER_PORT"), env.get("TORCHELASTIC_RUN_ID")]
    if not any(parts):
        return None
    # a restart of the same torchrun job (--max-restarts) is a new set of processes: a new exchange
    parts.append(env.get("TORCHELASTIC_RESTART_COUNT") or "0")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(p or "" for p in parts))[:120]


def from_process_group() -> RankInfo | None:
    """Return this process's rank in torch.distributed's default group while it exists, else ``None``.

    ``get_rank``/``get_world_size`` read the group's local state; they start no collective.
    """
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # a backend in a broken state: no rank rather than an error in the user's process
        return None
    if world < 2 or rank < 0:
        return None
    env = from_environment()
    if env is not None and (env.rank, env.world_size) == (rank, world):
        return env
    return RankInfo(rank, world)


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
