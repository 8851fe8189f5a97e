"""Which call ids the broker sent to which executor, kept on disk across its restarts.

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
import stat
import time
from pathlib import Path
from urllib.parse import quote, unquote

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
        _check_private(Path(directory))
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
                sent[unquote(cid)] = (unquote(executor), when)
        return sent

    def _rewrite(self, entries: dict[str, tuple[str, float]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a leftover, or a link planted there: removed, never followed
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "w", encoding="ascii") as f:
            for cid, (executor, when) in entries.items():
                f.write(_line(when, cid, executor))
        os.replace(tmp, self.path)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.lines = len(entries)

    def record(self, cid: str, executor: str) -> None:
        """Note that call ``cid`` was sent to ``executor``."""
        try:
            os.write(self.fd, _line(time.time(), cid, executor).encode("ascii"))
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


def _line(when: float, cid: str, executor: str) -> str:
    """One journal line. Ids are chosen by clients and executors: percent-encoded, so a space or a
    newline in one can never make a field or a line of its own (a forged entry)."""
    return f"{when:.3f} {quote(cid, safe='')} {quote(executor, safe='')}\n"


def _check_private(directory: Path) -> None:
    """The state directory must be ours and writable by nobody else: whoever can write it could
    plant links there or entries in the journal. Raises ``OSError`` saying what is wrong."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{directory} is not a directory (a symbolic link?)")
    if st.st_uid != os.geteuid():
        raise OSError(f"{directory} belongs to uid {st.st_uid}, not to this broker's ({os.geteuid()})")
    if st.st_mode & 0o022:
        raise OSError(f"{directory} has mode {stat.S_IMODE(st.st_mode):o}: others could write in it; "
                      "use a directory with mode 0700")
