"""The default toolkit: files in the workspace (``read_file``, ``write_file``, ``list_dir``), and the
two signals (``emit_note``, ``complete_task``). Nothing else: the shell is ``executor.toolkits.shell``.
Every path is resolved beneath the workspace by the kernel (``executor.toolkits.paths``), so none
leads out; ``write_file`` refuses a file with more than one hard link, and ``read_file`` reads at
most what the file holds. Errors are ordinary exceptions whose messages are written for the model
(``tool_error`` results). The tools' docstrings are shown to the model verbatim, so they stay short.
Why and how: docs/executor.md#the-toolkits.
"""

# No ``from __future__ import annotations`` here: the signature text shown to the model would read
# ``(path: 'str')`` instead of ``(path: str)``.

import codecs
import logging
import os
import stat

from executor import signals
from executor.registry import tool
from executor.toolkits.paths import make_parents, open_beneath, openat2_missing, relative

__all__ = ["complete_task", "emit_note", "list_dir", "read_file", "write_file"]

LIST_DIR_MAX_ENTRIES = 1000
READ_CHUNK = 1 << 20  # bytes per read: memory follows what the file holds, never max_bytes

_missing = openat2_missing()  # imported in the template at start-up, so this reaches the executor's log once
if _missing is not None:
    logging.getLogger("ciayn-executor").warning(
        "workspace file tools: %s; falling back to a realpath check, which a directory swapped for a "
        "symlink during a call can lead out of the workspace (--profile hardened confines the workers)",
        _missing,
    )


@tool(bundleable=True, idempotent=True)
def read_file(path: str, max_bytes: int = 200_000) -> str:
    """Read a UTF-8 text file in the workspace. Files longer than max_bytes are cut, with a note saying so."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be at least 1, not {max_bytes}")
    fd = open_beneath(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(f"{path!r} is a directory, not a file; use list_dir({path!r})")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path!r} is not a regular file (a device, socket or pipe); it cannot be read")
        data, truncated = _read_text_bytes(fd, path, min(max_bytes, st.st_size))
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        text = decoder.decode(data, final=not truncated)  # a cut multi-byte character is held back
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path!r} is not UTF-8 text (undecodable byte at offset {e.start}); it looks binary, "
            "and read_file reads text only"
        ) from None
    if not truncated:
        return text
    kept = len(data) - len(decoder.getstate()[0])
    return (
        f"{text}\n[read_file: truncated; showed the first {kept} of {size} bytes, "
        f"{max(size - kept, 0)} bytes cut; raise max_bytes to see more]"
    )


@tool
def write_file(path: str, content: str) -> str:
    """Create or overwrite a text file in the workspace (UTF-8), creating missing parent directories."""
    data = content.encode("utf-8")
    make_parents(path)
    # no O_TRUNC: the file is checked before anything in it changes
    fd = open_beneath(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY)
    with os.fdopen(fd, "wb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path!r} is not a regular file (a device, socket or pipe); it cannot be written")
        if st.st_nlink > 1:
            raise PermissionError(
                f"{path!r} has {st.st_nlink} hard links: other names, perhaps outside the workspace, share its "
                "content, so write_file does not write it; write to a new path instead"
            )
        f.truncate(0)
        f.write(data)
    return f"wrote {len(data)} bytes to {relative(path)}"


@tool(bundleable=True, idempotent=True)
def list_dir(path: str = ".") -> list[str]:
    """List a workspace directory: sorted names, directories with a trailing "/"."""
    fd = open_beneath(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise NotADirectoryError(f"{path!r} is a file, not a directory; use read_file({path!r})")
        with os.scandir(fd) as it:
            names = sorted(e.name + "/" if e.is_dir() else e.name for e in it)
    finally:
        os.close(fd)
    if len(names) > LIST_DIR_MAX_ENTRIES:
        more = len(names) - LIST_DIR_MAX_ENTRIES
        names = [*names[:LIST_DIR_MAX_ENTRIES], f"[... {more} more entries not shown]"]
    return names


@tool(bundleable=True)
def emit_note(text: str) -> str:
    """Show a short note to the user in the transcript."""
    signals.note(text)
    return "noted"


@tool
def complete_task(summary: str) -> str:
    """Declare the task done, with a one-line summary for the user. Call it once, at the end."""
    signals.complete(summary)
    return "task marked complete"


def _read_text_bytes(fd: int, path: str, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes, read in chunks of at most ``READ_CHUNK`` (a NUL ends it early: binary),
    and whether more followed (one byte more is read to know: the file may have grown)."""
    chunks: list[bytes] = []
    got = 0
    while got < limit:
        chunk = os.read(fd, min(READ_CHUNK, limit - got))
        if not chunk:
            return b"".join(chunks), False
        if b"\0" in chunk:
            raise ValueError(f"{path!r} is a binary file (it contains NUL bytes), not text; read_file reads text only")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks), bool(os.read(fd, 1))
