"""Where the processes of one job leave their reports for each other: the job's c10d store, or a private folder.

Under torchrun the agent runs a ``TCPStore`` for the whole job (``TORCHELASTIC_USE_AGENT_STORE=True``; the workers
reach it at ``MASTER_ADDR:MASTER_PORT``). It lives in the agent process, so it outlives every worker, and every node
reaches it: reports travel through it with no shared file system. A store is not a collective: a ``set`` or a
``check`` involves no other rank, and nothing here waits on one.

Where there is no such store (Lightning's own DDP launcher, ``mp.spawn``, child processes), the reports are files in
a folder that only this user can read and write (mode 0700, owned by this user); a folder of that name that belongs
to someone else, or that others can write, is refused, since a report read from it could have been planted.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Protocol

from ampdoctor.core.io import read_json, write_json_atomic
from ampdoctor.core.strict_json import json_text

__all__ = ["Mailbox", "StoreMailbox", "FolderMailbox", "private_folder", "agent_store_address", "alive"]

STORE_TIMEOUT = 5.0   # seconds to connect to the agent's store, and for one operation on it


class Mailbox(Protocol):
    """Named JSON objects that the processes of one job can leave for each other."""

    where: str     # for messages: what it is and where
    shared: bool   # every process of the job reaches it (a store, a shared folder); False: this node only

    def put(self, name: str, data: dict[str, Any]) -> None:
        """Leave ``data`` under ``name`` whole (a reader never sees half of it); raise ``OSError`` on failure."""

    def get(self, name: str) -> dict[str, Any] | None:
        """Return what is under ``name`` now, or None; never waits, never raises."""

    def remove(self, names: Iterable[str]) -> None:
        """Remove ``names`` (those that are there); never raises."""


class StoreMailbox:
    """The job's own c10d store (torchrun's agent store), under a prefix of this job's.

    Args:
        host, port: where the store listens (``MASTER_ADDR``, ``MASTER_PORT``).
        prefix: the keys of this exchange (a job may run several: a ``fit`` per callback run).
        timeout: seconds to connect and for each operation.

    Raises:
        OSError: the store cannot be reached (the caller falls back to a folder).
    """

    shared = True

    def __init__(self, host: str, port: int, prefix: str, timeout: float = STORE_TIMEOUT) -> None:
        import torch.distributed as dist

        self.where = f"the job's c10d store at {host}:{port}"
        try:
            client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                                   wait_for_workers=False)
            self._store = dist.PrefixStore(prefix, client)
        except Exception as exc:   # DistStoreError, RuntimeError: no store there, or it is gone
            raise OSError(f"cannot reach {self.where}: {exc}") from None

    def put(self, name: str, data: dict[str, Any]) -> None:
        try:
            self._store.set(name, json_text(data))
        except Exception as exc:
            raise OSError(f"cannot write {name!r} to {self.where}: {exc}") from None

    def get(self, name: str) -> dict[str, Any] | None:
        try:
            if not self._store.check([name]):
                return None
            data = json.loads(self._store.get(name).decode("utf-8"))
        except Exception:   # gone, or not ours
            return None
        return data if isinstance(data, dict) else None

    def remove(self, names: Iterable[str]) -> None:
        for name in names:
            try:
                self._store.delete_key(name)
            except Exception:
                pass


class FolderMailbox:
    """JSON files in a folder only this user can read and write (see `private_folder`).

    Args:
        folder: the folder; created (mode 0700) if missing.
        shared: whether every process of the job reaches it (``AMPDOCTOR_RANK_DIR`` on a shared file system).
        not_before: files last written before this time (seconds since the epoch) belong to an earlier launch with
            the same name, and are not read.

    Raises:
        PermissionError: the folder belongs to another user, or others can write to it.
    """

    def __init__(self, folder: str, *, shared: bool = False, not_before: float = 0.0) -> None:
        self.folder, self.shared, self.not_before = folder, shared, not_before
        self.where = f"the folder {folder!r}"
        private_folder(folder)

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def put(self, name: str, data: dict[str, Any]) -> None:
        write_json_atomic(self.path(name), data)

    def get(self, name: str) -> dict[str, Any] | None:
        try:
            if os.path.getmtime(self.path(name)) < self.not_before:
                return None   # an earlier launch's
        except OSError:
            return None
        return read_json(self.path(name))

    def names(self, prefix: str = "") -> list[str]:
        """Return the names of the files there that start with ``prefix``, oldest first."""
        try:
            found = [n for n in os.listdir(self.folder) if n.startswith(prefix) and not n.endswith(".partial")]
            return sorted(found, key=lambda n: os.path.getmtime(self.path(n)))
        except OSError:
            return []

    def remove(self, names: Iterable[str]) -> None:
        for name in names:
            try:
                os.remove(self.path(name))
            except OSError:
                pass


def private_folder(folder: str) -> None:
    """Create ``folder`` readable and writable by this user alone, or check that it is; else raise.

    Raises:
        PermissionError: it exists but is a link, not a folder, another user's, or writable by others; with what
            to do.
    """
    os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    if not hasattr(os, "getuid"):
        return   # Windows: the folder's ACL is the user profile's
    info = os.lstat(folder)
    why = ("is a symbolic link" if stat.S_ISLNK(info.st_mode) else "is not a folder" if not stat.S_ISDIR(info.st_mode)
           else f"belongs to user id {info.st_uid}, not to you ({os.getuid()})" if info.st_uid != os.getuid()
           else f"can be written by other users (mode {stat.S_IMODE(info.st_mode):o})"
           if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) else None)
    if why is not None:
        raise PermissionError(f"{folder!r} {why}: ampdoctor does not read reports from it or write reports to it; "
                              "remove it, or set AMPDOCTOR_RANK_DIR to a folder of your own")


def agent_store_address(environ: dict[str, str] | None = None) -> tuple[str, int] | None:
    """Return where torchrun's agent store listens, or None outside torchrun (or when it keeps no agent store).

    >>> agent_store_address({"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    ('10.0.0.1', 29500)
    >>> agent_store_address({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) is None   # rank 0 hosts it
    True
    """
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        return None
    return host, int(port)


def alive(pid: int) -> bool:
    """Return whether process ``pid`` (on this machine) runs: not gone, and not a zombie its parent has yet to reap.

    >>> alive(os.getpid())
    True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    try:   # Linux: a child that exited but was not reaped (Lightning's launcher does not wait) is state Z
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[:1] != ["Z"]
    except OSError:
        return True


def wait_until(condition: Any, deadline: float, stopped: Any = lambda: False, poll: float = 0.05) -> bool:
    """Poll ``condition()`` until it is true, ``deadline`` (``time.time()``) passes or ``stopped()``; return it."""
    while True:
        if condition():
            return True
        if stopped() or time.time() >= deadline:
            return False
        time.sleep(poll)
