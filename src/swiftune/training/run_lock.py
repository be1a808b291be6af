"""One run per output_dir: a lock file that a second run into the same folder reports clearly.

Two runs writing into the same ``output_dir`` overwrite each other's checkpoints, metrics and final
weights, and both exit 0. :class:`RunLock` creates ``output_dir/.swiftune-run.lock`` with
``O_CREAT | O_EXCL`` (atomic: only one process can create it), holding the owner's pid, host and
start time. A second run finds it and stops with :class:`RunLockedError`. A lock left by a process
that has died on this host (killed, crashed) is taken over with a warning; a lock from another host
cannot be checked, so the error says which file to delete if that run is gone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

logger = logging.getLogger(__name__)

LOCK_NAME = ".swiftune-run.lock"


class RunLockedError(OSError):
    """Another run holds the output_dir (an ``OSError``, as a refused file lock is)."""


def _process_start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether process ``pid`` of this host still runs (and, given its start time, is the same process)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    except OSError:
        return False
    if start_ticks is not None:
        now = _process_start_ticks(pid)
        if now is not None and now != start_ticks:
            return False  # the pid was reused by a later process
    return True


class RunLock:
    """``with RunLock(output_dir):`` (or :meth:`acquire` / :meth:`release`)."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.held = False
        self._token: str | None = None

    def _record(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "start_ticks": _process_start_ticks(os.getpid()),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"), "token": self._token}

    def _read(self) -> dict[str, Any] | None:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def acquire(self) -> RunLock:
        os.makedirs(self.output_dir, exist_ok=True)
        self._token = f"{os.getpid()}-{time.time_ns()}"
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._read()
                if owner == {}:
                    continue  # removed meanwhile: try again
                if owner is None:  # being written right now, or garbage
                    age = time.time() - os.path.getmtime(self.path) if os.path.exists(self.path) else 0
                    if age < 5:
                        time.sleep(0.2)
                        continue
                    owner = {}
                self._take_over_or_refuse(owner)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._record(), f)
            self.held = True
            return self
        raise RunLockedError(f"could not take the lock {self.path}: other processes keep creating it")

    def _take_over_or_refuse(self, owner: dict[str, Any]) -> None:
        pid, host = owner.get("pid"), owner.get("host")
        here = socket.gethostname()
        same_host = host == here
        if isinstance(pid, int) and same_host and pid == os.getpid():
            pass  # left by this process (an earlier trainer that never released it): ours again
        elif isinstance(pid, int) and same_host and pid_alive(pid, owner.get("start_ticks")):
            raise RunLockedError(
                f"output_dir {self.output_dir!r} is in use: another run (pid {pid} on {host}, started "
                f"{owner.get('started', '?')}) is writing there. Choose another output_dir for this run (or wait "
                f"for that one to finish); two runs in one folder overwrite each other's checkpoints.")
        elif not same_host and host:
            raise RunLockedError(
                f"output_dir {self.output_dir!r} is in use: another run (pid {pid} on host {host}, started "
                f"{owner.get('started', '?')}) is writing there. Choose another output_dir for this run; if that "
                f"run has ended (this host cannot check), delete {self.path} and start again.")
        else:
            logger.warning("swiftune: taking over the stale lock %s of a run that is no longer running "
                           "(pid %s on %s, started %s)", self.path, pid, host or "?", owner.get("started", "?"))
        if self._read() not in (owner, None):
            return  # another process took it over meanwhile: look again
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        owner = self._read()
        if owner and owner.get("token") == self._token:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
