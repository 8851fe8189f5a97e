"""The broker's journal: which call ids it sent to which executor, kept on disk across its restarts.

After a restart the broker learns from the executors that come back which calls they hold (their
``ready``). What it cannot learn from them is what an executor that did *not* come back was running:
without a journal, a client's resend of such a call looks new and would run a second time. With one
(``broker --state-dir DIR``), the broker answers it ``unavailable`` ("may have run") instead, unless the
tool is idempotent.

One line per call sent, appended with a single ``write`` to an ``O_APPEND`` file, so a broker killed
at any point leaves whole lines (a torn last line is skipped). Entries older than ``ttl`` are dropped
when the broker starts, and the file is compacted to what is left; when it grows past ``max_entries``
lines it is compacted to the newest half, so it stays bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("ciayn-broker")

JOURNAL_NAME = "dispatched.journal"
TTL = 3600.0  # seconds a dispatch is remembered across restarts
MAX_ENTRIES = 200_000  # lines before the file is compacted (about 12 MB); calls in flight are recent


class Journal:
    def __init__(self, directory: str | os.PathLike[str], *, ttl: float = TTL, max_entries: int = MAX_ENTRIES) -> None:
        self.path = Path(directory) / JOURNAL_NAME
        self.ttl = ttl
        self.max_entries = max_entries
        Path(directory).mkdir(mode=0o700, parents=True, exist_ok=True)
        earlier = self._load()
        self.previous: dict[str, str] = {cid: ex for cid, (ex, _) in earlier.items()}  # id -> executor
        self.lines = 0
        self.fd = -1
        self._rewrite(earlier)

    def _load(self) -> dict[str, tuple[str, float]]:
        try:
            text = self.path.read_bytes().decode("ascii", errors="replace")
        except FileNotFoundError:
            return {}
        now = time.time()
        sent: dict[str, tuple[str, float]] = {}
        for line in text.splitlines():
            parts = line.split(" ")
            if len(parts) != 3:
                continue  # a torn last line
            when_text, cid, executor = parts
            try:
                when = float(when_text)
            except ValueError:
                continue
            if now - when < self.ttl:
                sent[cid] = (executor, when)
        return sent

    def _rewrite(self, entries: dict[str, tuple[str, float]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", encoding="ascii") as f:
            for cid, (executor, when) in entries.items():
                f.write(f"{when:.3f} {cid} {executor}\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.lines = len(entries)

    def record(self, cid: str, executor: str) -> None:
        """Note that call ``cid`` was sent to ``executor`` (ids and executor ids hold no spaces)."""
        try:
            os.write(self.fd, f"{time.time():.3f} {cid} {executor}\n".encode("ascii", errors="replace"))
        except OSError as e:
            log.error("cannot write the broker journal %s: %s", self.path, e)
            return
        self.lines += 1
        if self.lines > self.max_entries:
            self._compact()

    def _compact(self) -> None:
        """Keep the newest half of ``max_entries`` that are younger than ``ttl``."""
        kept = dict(list(self._load().items())[-max(1, self.max_entries // 2):])
        self.previous = {cid: ex for cid, ex in self.previous.items() if cid in kept}
        self._rewrite(kept)

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
