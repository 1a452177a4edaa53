"""The coordinator's journal of requests in flight: on disk, so they outlive the process.

A request is written here (and fsynced) before the coordinator acknowledges
it to the broker, and removed once its response has been acknowledged by the
broker. A coordinator that starts reads its journal and answers every request
in it: after `kill -9`, a power cut or an out-of-memory kill, no request that
was acknowledged is forgotten. docs/failover.md says why a journal on disk and
not an acknowledgement held back until the answer.

One file per request, named by a hash of (client, id) so no id can name a path:
written to a temporary name, fsynced and renamed, then the directory fsynced,
so a crash leaves either the whole entry or none. The journal holds at most
the requests admitted, in flight (`max_in_flight`) and waiting for a slot
(`max_queue`), each at most a request's size limit, and at most `MAX_BAD`
unreadable entries set aside.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from edgebus.core.errors import EdgebusError

log = logging.getLogger(__name__)

_SUFFIX = ".json"
_BAD = ".bad"
# Unreadable entries set aside for a person to look at: a few are evidence
# of what went wrong, more only fill the disk (a disk that goes on losing
# blocks, restart after restart). Beyond this, the oldest go.
MAX_BAD = 16


@dataclass(frozen=True)
class Entry:
    """One request as it arrived: enough to serve it again from the start."""

    client: str
    request_id: str
    payload: bytes  # the request message, as the gateway sent it
    response_topic: str | None = None  # MQTT 5 response topic
    correlation: bytes | None = None  # MQTT 5 correlation data
    # The sampling seed it was first served with: served again, it draws the same tokens.
    seed: int | None = None
    # When it arrived (time.time()): a restarted coordinator serves its journal in this
    # order, so requests that waited for a slot keep their places.
    received: float | None = None

    def to_json(self) -> str:
        return json.dumps({
            "client": self.client, "id": self.request_id,
            "payload": base64.b64encode(self.payload).decode(),
            "response_topic": self.response_topic,
            "correlation": (None if self.correlation is None
                            else base64.b64encode(self.correlation).decode()),
            "seed": self.seed, "received": self.received})

    @classmethod
    def from_json(cls, text: str) -> Entry:
        data = json.loads(text)
        correlation = data.get("correlation")
        seed = data.get("seed")  # absent from an entry an older version wrote, as received
        received = data.get("received")
        return cls(str(data["client"]), str(data["id"]), base64.b64decode(data["payload"]),
                   data.get("response_topic"),
                   None if correlation is None else base64.b64decode(correlation),
                   None if seed is None else int(seed),
                   None if received is None else float(received))


def key_name(client: str, request_id: str) -> str:
    """The file name of (client, id): a hash, so ids like '..' name no path."""
    digest = hashlib.sha256(f"{client}\0{request_id}".encode()).hexdigest()[:40]
    return digest + _SUFFIX


class Journal:
    """Requests in flight, one fsynced file each, under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        # add() and remove() run on worker threads: an empty journal's directory
        # is removed, and must not go between another add()'s mkdir and its write.
        self._lock = threading.Lock()

    def open(self) -> list[Entry]:
        """Return the entries a previous run left.

        An entry that cannot be read (a disk that lost a block) is renamed to
        `*.bad`, logged and skipped: it must not stop the coordinator. Of those,
        the newest `MAX_BAD` are kept.
        """
        if not self.directory.is_dir():
            return []
        entries = []
        for path in sorted(self.directory.glob(f"*{_SUFFIX}")):
            try:
                entries.append(Entry.from_json(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("journal entry %s is unreadable (%s); moved to %s.bad", path, exc,
                          path.name)
                path.replace(path.with_suffix(_BAD))
        self._bound_bad()
        for stale in self.directory.glob(".*.tmp"):  # a write that a crash cut short
            stale.unlink(missing_ok=True)
        return entries

    def is_empty(self) -> bool:
        """No request is journaled (a coordinator's lock file aside)."""
        return not any(self.directory.glob(f"*{_SUFFIX}"))

    def _bound_bad(self) -> None:
        bad = sorted(self.directory.glob(f"*{_BAD}"), key=lambda p: p.stat().st_mtime_ns)
        for old in bad[:max(0, len(bad) - MAX_BAD)]:
            log.warning("journal: removing %s, more than %d unreadable entries are kept",
                        old, MAX_BAD)
            old.unlink(missing_ok=True)

    def add(self, entry: Entry) -> None:
        """Write `entry` durably (blocking: call it from a worker thread)."""
        final = self.directory / key_name(entry.client, entry.request_id)
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    out.write(entry.to_json())
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, final)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self._sync_directory()

    def remove(self, client: str, request_id: str) -> None:
        """Forget a request that has been answered (blocking: call it from a worker thread).

        An empty journal leaves no directory behind (nor an empty one for its plant).
        """
        with self._lock:
            (self.directory / key_name(client, request_id)).unlink(missing_ok=True)
            self._sync_directory()
            for directory in (self.directory, self.directory.parent):
                try:
                    directory.rmdir()
                except OSError:  # not empty: other requests, or other coordinators
                    break

    def _sync_directory(self) -> None:
        # A rename or unlink is durable only once the directory is: without
        # this a power cut could bring an answered request back, or lose a new one.
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def default_directory(plant_id: str, topic_root: str, agent_id: str) -> Path:
    """$EDGEBUS_HOME/journal/<plant>-<root hash>/<agent>: systemd's StateDirectory in the unit.

    The topic root is in the name so two plants (or test runs) that share a
    plant id never resume each other's requests.
    """
    home = os.environ.get("EDGEBUS_HOME")
    if not home:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = str(Path(cache) / "edgebus")
    root = hashlib.sha256(topic_root.encode()).hexdigest()[:8]
    return Path(home) / "journal" / f"{plant_id}-{root}" / agent_id


# In the journal's directory, so that it names exactly what it guards; a dot hides
# it from `open()`'s glob of entries.
_LOCK_NAME = ".lock"


class JournalLock:
    """The one coordinator process that serves a journal holds this (`flock`).

    Two coordinators with one id and one journal (a second `edgebus coordinator`
    on the box, started by hand beside systemd's) would take turns at one MQTT
    session, each ending the other's, and both serve the journal: the second
    is refused at start instead. The kernel drops the lock with the process,
    so a `kill -9` leaves nothing to clean up by hand.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / _LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise EdgebusError naming the process that holds it."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise EdgebusError(
                    f"another coordinator process (pid {holder}) serves the journal "
                    f"{self.directory}: it holds {self.path}. Two coordinators with one id "
                    "would fight over one MQTT session. If it is this plant's, stop it, or "
                    "run this one as another of coordinator.instances (EDGEBUS_INSTANCE). If "
                    "it is another plant's (two plant files on one box, both with the "
                    "defaults plant_id: plant and topic_root: edgebus/plant), give this "
                    "plant a plant_id and a topic_root of its own in its plant file: the "
                    "journal, the MQTT client ids and the topics all go by them") from None
            # A holder releasing it unlinks the file: a lock on that old file guards
            # nothing, since the next process creates and locks a new one.
            try:
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Let the lock go; an empty journal then leaves no directory behind."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still held: see acquire()
        os.close(fd)
        for directory in (self.directory, self.directory.parent):
            try:
                directory.rmdir()
            except OSError:  # not empty: requests left for the next run, or other journals
                break
