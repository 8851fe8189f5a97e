"""The ``filesystem`` layer: the read-only root a worker pivots into, and the mounts it needs.

``build_root`` runs once in the template, in a private mount namespace of its own (nothing it mounts
is visible to, or left on, the host): a tmpfs at ``STAGE`` holding bind mounts of what tools need
(system files without shadow files, the interpreter, venv and tool modules, the workspace), made
read-only and nosuid as a whole, with ``config.hide`` covered. ``apply_filesystem`` runs in each
worker: its own size-capped ``/tmp`` and ``/dev/shm``, its own ``/proc`` (``/proc/sys``
read-only), the ``--workspace-rw`` overlay, then ``pivot_root``. ``check_idmap`` tells whether a
workspace takes the idmapped mount ``--workspace-rw`` needs. Raises ``LayerError``.
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from executor.sandbox import overlay
from executor.sandbox.config import HardenedConfig
from executor.sandbox.identity import NOBODY, probe_root
from executor.sandbox.kernel import (
    AT_EMPTY_PATH,
    AT_FDCWD,
    AT_RECURSIVE,
    CLONE_NEWNS,
    CLONE_NEWUSER,
    MNT_DETACH,
    MOUNT_ATTR_IDMAP,
    MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOSUID,
    MOUNT_ATTR_RDONLY,
    MOVE_MOUNT_F_EMPTY_PATH,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    NR,
    OPEN_TREE_CLOEXEC,
    OPEN_TREE_CLONE,
    LayerError,
    check,
    libc,
    syscall,
)
from executor.sandbox.seccomp import probe_x86_64

STAGE = "/dev/shm"  # where the template mounts the root it builds (in its own mount namespace only)
SECRET_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-")
DEVICES = ("null", "zero", "full", "random", "urandom")
TMPFS_INODES = 65536  # files in /tmp or /dev/shm: their inodes are kernel memory


@dataclass
class View:
    """The root the template built, and what each worker still mounts on it (what lies under the
    worker's own ``/tmp`` can only be mounted after it)."""

    root: str = STAGE
    late_binds: list[tuple[str, str, bool]] = field(default_factory=list)  # (source, target in the view, read-only)
    staged_workspace: str = ""  # an idmapped workspace under /tmp waits here for each worker
    late_hides: list[str] = field(default_factory=list)


def probe_filesystem() -> str | None:
    return probe_root() or probe_x86_64() or (None if os.path.isdir(STAGE) else f"no {STAGE} to build the root on")


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None,
          layer: str = "filesystem") -> None:
    check(layer, f"mount {dst}", libc.mount(
        src.encode() if src else None, dst.encode(), fstype.encode() if fstype else None,
        ctypes.c_ulong(flags), data.encode() if data else None))


def _bind(src: str, dst: str, readonly: bool) -> None:
    mount(src, dst, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (MS_RDONLY if readonly else 0)
    mount(None, dst, None, flags)


def _detach(what: str, path: str) -> None:
    check("filesystem", what, libc.umount2(path.encode(), MNT_DETACH))


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _readonly_tree(path: str) -> None:
    """Read-only and nosuid, recursively (one mount_setattr call for the whole tree)."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    check("filesystem", f"mount_setattr {path}", syscall(
        NR["mount_setattr"], ctypes.c_int(AT_FDCWD), path.encode(), ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr))))


# --------------------------------------------------------------------------------------------------
# in the template: the root, once


def build_root(config: HardenedConfig, keeper: bool) -> View:
    """Once, in the template: a private mount namespace and, in it, the read-only root. ``keeper``:
    with ``--workspace-rw``, room for each call's upper layer and the keepers' tally."""
    check("mount-ns", "unshare(CLONE_NEWNS) in the template", libc.unshare(CLONE_NEWNS))
    mount(None, "/", None, MS_REC | MS_PRIVATE, layer="mount-ns")
    view = View()
    root = view.root
    empty = _skeleton(root)
    workspace = os.path.realpath(config.workspace)
    rw = config.workspace_rw
    for src in _view_roots(workspace, config.hide):
        if not under(src, "/tmp"):
            _mountpoint(root, src)  # the rw workspace's too
            if not (src == workspace and rw):
                mount(src, root + src, None, MS_BIND | MS_REC)
    for secret in SECRET_FILES:
        if os.path.isfile(root + secret):
            mount(empty, root + secret, None, MS_BIND)
    for hidden in config.hide:
        hidden = os.path.realpath(hidden)
        if under(hidden, "/tmp"):
            view.late_hides.append(hidden)
        else:
            hide(root, hidden)
    if rw and under(workspace, "/tmp"):
        os.makedirs(root + "/.ciayn-workspace")
    if keeper:
        os.makedirs(root + overlay.UPPER)
        os.makedirs(root + overlay.TALLY)
    _readonly_tree(root)
    if keeper:  # one tmpfs for this executor's keepers (their mount namespaces copy it), root's only
        mount("tmpfs", root + overlay.TALLY, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
              "size=64k,nr_inodes=16,mode=0700")
    late = [src for src in _view_roots(workspace, config.hide) if under(src, "/tmp")]
    view.late_binds = [(src, src, True) for src in late if not (src == workspace and rw)]
    if rw:
        _bind_workspace_rw(view, workspace, config)
    return view


def _skeleton(root: str) -> str:
    """The root's own tmpfs: its directories, the host's top-level symlinks, the device nodes and
    stdio links, and an empty file to cover secrets with (returned)."""
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for name in ("tmp", "proc", "dev", "dev/shm", "sys", "run", "home", "var", ".ciayn-empty"):
        os.makedirs(f"{root}/{name}", exist_ok=True)
    for name in sorted(os.listdir("/")):  # merged /usr: bin, lib, lib64, sbin are symlinks
        if os.path.islink(f"/{name}"):
            os.symlink(os.readlink(f"/{name}"), f"{root}/{name}")
    for node in DEVICES:
        Path(f"{root}/dev/{node}").touch()
        mount(f"/dev/{node}", f"{root}/dev/{node}", None, MS_BIND)  # a device node: no nodev
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    empty = f"{root}/.ciayn-empty/file"
    Path(empty).touch(mode=0)
    os.chmod(empty, 0)
    return empty


def _bind_workspace_rw(view: View, workspace: str, config: HardenedConfig) -> None:
    """The tools act as the workspace's owner in it: an idmapped mount, files stay its owner's."""
    st = os.stat(workspace)
    userns = _idmap_userns((st.st_uid, config.uid), (st.st_gid, config.gid))
    try:
        if under(workspace, "/tmp"):
            view.staged_workspace = view.root + "/.ciayn-workspace"
            _idmapped_bind(workspace, view.staged_workspace, userns)
            view.late_binds.append((view.staged_workspace, workspace, False))
        else:
            _idmapped_bind(workspace, view.root + workspace, userns)
    finally:
        os.close(userns)


# --------------------------------------------------------------------------------------------------
# in the worker


def apply_filesystem(view: View, config: HardenedConfig, keeper: bool) -> None:
    """The worker's own mounts on the view, then ``pivot_root`` into it; the cwd is its ``/tmp``."""
    root = view.root
    size = f"size={config.tmp_mb}m,nr_inodes={TMPFS_INODES},mode=1777"
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, size)
    mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={config.shm_mb}m,nr_inodes={TMPFS_INODES},mode=1777")
    for src, dst, readonly in view.late_binds:  # under /tmp: only now, on top of the new /tmp
        _mountpoint(root, dst)
        _bind(src, root + dst, readonly)
    if view.staged_workspace:  # the idmapped workspace was bound from its staging place: drop that one
        _detach("detach the staged workspace", view.staged_workspace)
    for hidden in view.late_hides:
        hide(root, hidden)
    if keeper:
        _mount_overlay(root, config)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _bind(root + "/proc/sys", root + "/proc/sys", readonly=True)
    os.chdir(root)
    check("filesystem", "pivot_root", syscall(NR["pivot_root"], b".", b"."))
    check("filesystem", "detach the old root", libc.umount2(b".", MNT_DETACH))
    os.chdir("/tmp")
    # The cwd is scratch now (tools find the workspace by name); home and temp are the scratch too.
    os.environ.update({"CIAYN_WORKSPACE": config.workspace, "HOME": "/tmp", "TMPDIR": "/tmp"})


def _mount_overlay(root: str, config: HardenedConfig) -> None:
    """``--workspace-rw``: the workspace becomes an overlay whose upper layer is the call's tmpfs (the
    keeper mounted it; its own mount is dropped here, so the tools reach it only through the
    overlay). Hidden paths inside the workspace are hidden again on top (an overlay layer does not
    show the mounts under its directory)."""
    workspace = os.path.realpath(config.workspace)
    lower, upper = root + workspace, root + overlay.UPPER
    mount("overlay", lower, "overlay", MS_NOSUID | MS_NODEV,
          f"lowerdir={lower},upperdir={upper}/upper,workdir={upper}/work,{overlay.OVERLAY_OPTIONS}")
    _detach("detach the call's upper layer", upper)
    _detach("detach the keepers' tally", root + overlay.TALLY)
    for hidden in config.hide:
        if under(os.path.realpath(hidden), workspace):
            hide(root, os.path.realpath(hidden))


# --------------------------------------------------------------------------------------------------
# the idmapped workspace


def _idmap_userns(uid: tuple[int, int], gid: tuple[int, int]) -> int:
    """A user namespace (its fd) for an idmapped mount showing files of ``uid[0]``/``gid[0]`` as
    owned by ``uid[1]``/``gid[1]`` (and files those write as owned by ``uid[0]``/``gid[0]``). A
    child holds the namespace while its maps are written, then exits."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        ok = libc.unshare(CLONE_NEWUSER) == 0
        os.read(r, 1)
        os._exit(0 if ok else 1)
    os.close(r)
    try:
        deadline = time.monotonic() + 5
        while os.readlink(f"/proc/{pid}/ns/user") == os.readlink("/proc/self/ns/user"):
            if time.monotonic() > deadline:
                raise LayerError("filesystem", "the helper for the workspace's id mapping did not start")
            time.sleep(0.001)
        Path(f"/proc/{pid}/uid_map").write_text(f"{uid[0]} {uid[1]} 1")
        Path(f"/proc/{pid}/gid_map").write_text(f"{gid[0]} {gid[1]} 1")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def _idmapped_bind(src: str, dst: str, userns: int) -> None:
    """Bind ``src`` at ``dst`` through the id mapping of ``userns`` (open_tree, mount_setattr, move_mount)."""
    tree = check("filesystem", f"open_tree {src}", syscall(
        NR["open_tree"], ctypes.c_int(AT_FDCWD), src.encode(), ctypes.c_uint(OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)))
    try:
        attr = _MountAttr(MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, userns)
        check("filesystem", f"id-map {src}", syscall(
            NR["mount_setattr"], ctypes.c_int(tree), b"", ctypes.c_uint(AT_EMPTY_PATH), ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr))))
        check("filesystem", f"move_mount {dst}", syscall(
            NR["move_mount"], ctypes.c_int(tree), b"", ctypes.c_int(AT_FDCWD), dst.encode(),
            ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)))
    finally:
        os.close(tree)


def check_idmap(workspace: str, uid: int = NOBODY, gid: int = NOBODY) -> str | None:
    """Whether the workspace's filesystem takes the idmapped mount ``--workspace-rw`` needs (not all
    do, e.g. NFS), and an overlay on top of it (``executor.sandbox.overlay``): tried in a child with a
    mount namespace of its own. None, or why not."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        message = b""
        try:
            check("mount-ns", "unshare(CLONE_NEWNS)", libc.unshare(CLONE_NEWNS))
            mount(None, "/", None, MS_REC | MS_PRIVATE, layer="mount-ns")
            st = os.stat(workspace)
            userns = _idmap_userns((st.st_uid, uid), (st.st_gid, gid))
            _idmapped_bind(workspace, workspace, userns)
            mount("tmpfs", STAGE, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0700")  # only in this namespace
            for name in ("upper", "work"):
                os.mkdir(f"{STAGE}/{name}")
            mount("overlay", workspace, "overlay", MS_NOSUID | MS_NODEV,
                  f"lowerdir={workspace},upperdir={STAGE}/upper,workdir={STAGE}/work,{overlay.OVERLAY_OPTIONS}")
        except BaseException as e:
            message = str(e).encode()[:1000]
        os.write(w, message)
        os._exit(0)
    os.close(w)
    try:
        reason = os.read(r, 1000).decode(errors="replace")
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return reason or None


# --------------------------------------------------------------------------------------------------
# paths of the view


def _mountpoint(root: str, path: str) -> None:
    """Make the directory ``root + path`` in the view, never through a symlink (one could lead out
    of the view, onto the host)."""
    current = root
    for part in path.strip("/").split("/"):
        current = f"{current}/{part}"
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            os.mkdir(current, 0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise LayerError("filesystem", f"cannot show {path} in the view: {current[len(root):]} is not a directory")


def hide(root: str, path: str) -> None:
    """Cover ``path`` inside the view, if the view shows it: an empty directory or an empty file."""
    if os.path.isdir(root + path):
        mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0")
    elif os.path.lexists(root + path):
        mount(f"{root}/.ciayn-empty/file", root + path, None, MS_BIND)


def under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _view_roots(workspace: str, hide: tuple[str, ...]) -> list[str]:
    """The host directories a worker sees (read-only unless it is the writable workspace): system
    files, the interpreter and venv (and the ``sys.path`` entries inside them), every directory a
    module was imported from, the workspace. Not ``sys.path`` as such: ``python -m`` puts the
    working directory there, often a home directory. Nested ones are dropped (their parent shows
    them)."""
    prefixes = {sys.base_prefix, sys.prefix, sys.exec_prefix}
    wanted = {"/usr", "/etc", workspace, *prefixes}
    for entry in sys.path:
        if entry and os.path.isdir(entry) and any(under(os.path.realpath(entry), os.path.realpath(p))
                                                  for p in prefixes):
            wanted.add(entry)
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and os.path.isabs(path):
            wanted.add(os.path.dirname(path))
    real = {os.path.realpath(p) for p in wanted}
    real = {p for p in real if os.path.isdir(p) and p != "/" and not under(p, STAGE) and not under(p, "/proc")}
    roots = sorted(p for p in real if not any(q != p and under(p, q) for q in real))
    if workspace in real and workspace not in roots:
        roots.append(workspace)  # its own mount even under a parent shown read-only (rw, or hidden parts)
    return [r for r in roots if not any(under(r, os.path.realpath(h)) for h in hide)]
