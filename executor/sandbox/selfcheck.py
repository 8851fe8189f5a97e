"""``ciayn-executor selfcheck``: attack the hardened profile from inside a real hardened worker, and
judge the outcome on the host.

``Target`` starts a real executor (``serve --profile hardened``) whose tools are the escape attempts
of ``executor.sandbox.attempts``, with what they aim at on the host; each ``Attempt`` of
``ATTEMPTS`` is called over ZeroMQ as a client would and passes only if it was denied. Once the
executor stopped, nothing it did may stay on the host (processes, files in ``/dev/shm``, control
groups, mounts). ``main`` prints the table (layer, attempt, expected, observed), or with ``--json``
the same rows for CI, and exits 0 only if every attempt was denied; ``serve --profile hardened``
runs it before serving (``executor.sandbox.start``). This module runs in the CLI's process, never in
a template or worker: it is the one of ``executor/sandbox/`` that speaks ZeroMQ.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from executor.sandbox import layers, overlay

SECRET_ENV = "CIAYN_SELFCHECK_SECRET"
START_TIMEOUT = 30.0  # the executor under test imports only the attempts
CALL_TIMEOUT = 20.0
STOP_TIMEOUT = 10.0
MEMORY_MB = 128
PROCESSES = 32
QUOTA_MB = 16  # --workspace-quota of the executor under test with --workspace-rw (its writes are in memory)



@dataclass
class Row:
    layer: str
    attempt: str
    expected: str
    observed: str = ""
    ok: bool = False


@dataclass
class Context:
    """What the attempts need to know about the host side."""

    endpoint: str
    sock_path: str
    workspace: str
    supervisor: int
    template: int
    sibling: int
    controller: int
    tcp_port: int
    udp_port: int
    token: str
    secret: str
    abstract: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    keeper: int = 0  # --workspace-rw: the sibling's keeper (root, outside its sandbox)

    def executor_pids(self) -> list[int]:
        """The executor's processes a tool must not reach: supervisor, template, a sibling call
        (and, with --workspace-rw, that call's keeper)."""
        return [self.supervisor, self.template, self.sibling, *([self.keeper] if self.keeper else [])]


def _denied(observed: Any) -> bool:
    items = observed if isinstance(observed, list) else [observed]
    return all(isinstance(o, str) and o.startswith("denied") for o in items)


def _errno_in(*names: str) -> Callable[[Any], bool]:
    def judge(observed: Any) -> bool:
        items = observed if isinstance(observed, list) else [observed]
        return all(isinstance(o, str) and o.startswith("denied") and any(n in o for n in names) for o in items)
    return judge


@dataclass(frozen=True)
class Attempt:
    """One escape: the tool and its arguments, what must happen, and how to judge the outcome.
    ``judge`` gets the tool's value (the call failed when ``error_kind`` is set instead)."""

    layer: str
    name: str
    expected: str
    tool: str
    args: Callable[[Context], dict[str, Any]]
    judge: Callable[[Any], bool] = _denied
    error_kind: str | None = None  # the call itself must fail with this kind
    host_check: Callable[[Context], str | None] | None = None  # after the call: what it left, or None
    mode: str = "any"  # "ro" or "rw": only against a read-only workspace, or only with --workspace-rw


def _targets(c: Context) -> dict[str, Any]:
    return {"pids": c.executor_pids()}


ATTEMPTS: tuple[Attempt, ...] = (
    Attempt("seccomp, pid-ns", "ptrace the supervisor, the template, a sibling worker", "EPERM/ESRCH",
            "ptrace_attach", _targets, _errno_in("EPERM", "ESRCH")),
    Attempt("pid-ns, identity", "read another call's memory via /proc/PID/mem", "ENOENT/EACCES",
            "read_proc_mem", _targets),
    Attempt("seccomp, pid-ns", "read another call's memory via process_vm_readv", "EPERM/ESRCH",
            "process_vm_readv", _targets, _errno_in("EPERM", "ESRCH")),
    Attempt("pid-ns, landlock", "signal the supervisor, the template, a sibling, the controller", "ESRCH/EPERM",
            "signal_pids", lambda c: {"pids": [*c.executor_pids(), c.controller]},
            _errno_in("ESRCH", "EPERM")),
    Attempt("filesystem, cgroup-ns", "move itself out of its control groups (cgroup.procs)", "ENOENT/EROFS",
            "leave_cgroup", lambda c: {}),
    Attempt("filesystem", "freeze itself with the v1 freezer", "denied", "freeze_self", lambda c: {}),
    Attempt("filesystem", "fill /dev/shm past its cap", "ENOSPC", "write_dev_shm",
            lambda c: {"name": f"ciayn-selfcheck-{c.token}-big", "mb": 200}, _errno_in("ENOSPC", "EFBIG")),
    Attempt("filesystem", "leave a file in /dev/shm after the call", "gone from the host", "write_dev_shm",
            lambda c: {"name": f"ciayn-selfcheck-{c.token}", "mb": 1}, lambda o: True,
            host_check=lambda c: _shm_left(c.token)),
    Attempt("filesystem", "write to the workspace (read-only)", "EROFS/EACCES", "write_file",
            lambda c: {"path": os.path.join(c.workspace, "escaped.txt")}, mode="ro"),
    Attempt("filesystem", "write to the workspace (--workspace-rw), as its owner", "written, the owner's",
            "write_file", lambda c: {"path": os.path.join(c.workspace, "written.txt")},
            lambda o: isinstance(o, str) and o.startswith("ALLOWED: 'wrote"), mode="rw",
            host_check=lambda c: _not_owners(c.workspace, "written.txt")),
    Attempt("landlock, seccomp", "leave a FIFO or socket in the workspace (--workspace-rw)", "EPERM/EACCES",
            "make_special", lambda c: {"directory": c.workspace}, _errno_in("EPERM", "EACCES"), mode="rw"),
    Attempt("seccomp", "leave a set-user-ID file in the workspace (--workspace-rw)", "EPERM", "make_setuid_file",
            lambda c: {"directory": c.workspace}, _errno_in("EPERM"), mode="rw"),
    Attempt("filesystem", f"fill the disk through the workspace (--workspace-rw, {4 * QUOTA_MB} MiB at a "
            f"{QUOTA_MB} MiB quota)", "error kind output_limit; workspace within its quota", "fill_workspace",
            lambda c: {"directory": c.workspace, "mb": 4 * QUOTA_MB}, error_kind="output_limit", mode="rw",
            host_check=lambda c: _over_quota(c.workspace)),
    Attempt("filesystem, landlock", "write outside scratch (/etc, /usr, /)", "EROFS/EACCES", "write_file",
            lambda c: {"path": "/etc/ciayn-escaped"}),
    Attempt("capabilities", "raise hard rlimits (or soft up to hard)", "EPERM", "raise_rlimits", lambda c: {}),
    Attempt("filesystem, identity", "read /etc/shadow", "EACCES/empty", "read_file",
            lambda c: {"paths": ["/etc/shadow", "/etc/gshadow"]}),
    Attempt("filesystem", "read SSH keys and home directories", "ENOENT", "read_file",
            lambda c: {"paths": ["/root/.ssh", "/root/.ssh/id_rsa", "/home"]},
            lambda o: all(x.startswith("denied") or x.startswith("ALLOWED: 'listed /home: []") for x in o)),
    Attempt("identity", "read a root-only file in the workspace", "EACCES", "read_file",
            lambda c: {"paths": [os.path.join(c.workspace, "root-only.txt")]}, _errno_in("EACCES"), mode="ro"),
    Attempt("env allowlist", "read an environment secret not passed with --pass-env", "not found",
            "find_secret", lambda c: {"digest": hashlib.sha256(c.secret.encode()).hexdigest()}, lambda o: o == []),
    Attempt("net-ns, landlock", "exfiltrate over loopback TCP to the host", "ENETUNREACH/EACCES", "tcp_connect",
            lambda c: {"host": "127.0.0.1", "port": c.tcp_port}),
    Attempt("net-ns, landlock", "TCP connect to a port it listens on", "denied", "tcp_self", lambda c: {}),
    Attempt("net-ns", "UDP send to the host", "ENETUNREACH", "udp_send",
            lambda c: {"host": "127.0.0.1", "port": c.udp_port, "payload": c.token}),
    Attempt("net-ns", "DNS lookup", "gaierror", "dns_lookup", lambda c: {"name": "pypi.org"}),
    Attempt("filesystem", "write /proc/sys", "EROFS/EACCES", "write_proc_sys", lambda c: {}),
    Attempt("seccomp, capabilities", "remount / read-write", "EPERM", "remount_rw", lambda c: {}),
    Attempt("identity, no-new-privs", "setuid(0)", "EPERM", "become_root", lambda c: {}, _errno_in("EPERM")),
    Attempt("cgroups", f"fork past the process limit ({PROCESSES})", "EAGAIN", "fork_bomb",
            lambda c: {"limit": 4 * PROCESSES}, _errno_in("EAGAIN")),
    Attempt("cgroups", "use more than one core (3 processes spinning for 2 s)", "at most ~2.2 CPU s",
            "cpu_hog", lambda c: {"processes": 3, "seconds": 2.0}, lambda o: isinstance(o, float) and o <= 2.3),
    Attempt("cgroups", f"allocate past the memory limit ({MEMORY_MB} MB, shared memory)", "error kind memory",
            "shared_memory_bomb", lambda c: {"mb": 4 * MEMORY_MB}, error_kind="memory"),
    Attempt("seccomp", "unshare (user and network namespaces)", "EPERM", "unshare_userns", lambda c: {},
            _errno_in("EPERM")),
    Attempt("filesystem", "connect to the executor's socket", "ENOENT", "connect_unix",
            lambda c: {"path": c.sock_path}),
    Attempt("filesystem", "connect to every UNIX socket in its view", "none found, or refused", "connect_found_sockets",
            lambda c: {}),
    Attempt("net-ns, landlock", "connect to the host's abstract UNIX socket", "ECONNREFUSED/EPERM",
            "connect_abstract", lambda c: {"name": c.abstract}),
    Attempt("pid-ns", "kill every process it may (kill -1)", "only its own; the executor serves on",
            "kill_everything", lambda c: {}, lambda o: "NOT TRIED" not in o, host_check=lambda c: _executor_gone(c)),
    Attempt("worker integrity", "hold a descriptor besides stdio and its channel", "one socket (the channel)",
            "inherited_descriptors", lambda c: {}, lambda o: len(o) == 1 and "socket:" in o[0]),
    Attempt("seccomp", "call the denied system calls", "all EPERM", "forbidden_syscalls", lambda c: {},
            lambda o: o == []),
    Attempt("seccomp", "open netlink, packet, raw, vsock and AF_ALG sockets", "EPERM", "special_sockets",
            lambda c: {}, _errno_in("EPERM")),
    Attempt("seccomp", "make a set-user-ID or set-group-ID file", "EPERM", "make_setuid_file",
            lambda c: {"directory": "/tmp"}, _errno_in("EPERM")),
    Attempt("pid-ns", "see other processes", "only itself (pid 1)", "see_processes", lambda c: {},
            lambda o: o == [1]),
    Attempt("capabilities, no-new-privs, seccomp", "hold privileges", "uid != 0, no capabilities, nnp, seccomp",
            "privileges", lambda c: {},
            lambda o: all(o.get(k) == "0000000000000000" for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"))
            and o.get("NoNewPrivs") == "1" and o.get("Seccomp") == "2" and not o.get("Uid", "0").startswith("0")
            and o.get("Groups", "") == ""),
    Attempt("pid-ns, cgroups", "leave a process running after the call", "none left", "spawn_daemon",
            lambda c: {"token": c.token}, lambda o: True, host_check=lambda c: _processes_left(c.token)),
    Attempt("filesystem", "import a module only inside a call (interpreter readable)", "works", "lazy_import",
            lambda c: {}, lambda o: isinstance(o, str) and o.endswith("ok")),
)


def _executor_gone(c: Context) -> str | None:
    """After kill -1 inside: the supervisor, the template and the sibling's call must be alive."""
    dead = []
    for what, pid in (("supervisor", c.supervisor), ("template", c.template), ("sibling worker", c.sibling),
                      *((("its keeper", c.keeper),) if c.keeper else ())):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead.append(what)
    return f"KILLED on the host: {', '.join(dead)}" if dead else None


def _not_owners(workspace: str, name: str) -> str | None:
    """What is wrong with ``name``, written in the workspace by a tool: it must be the workspace owner's."""
    try:
        owner, got = os.stat(workspace).st_uid, os.stat(os.path.join(workspace, name)).st_uid
    except OSError as e:
        return f"NOT WRITTEN: {e}"
    return None if got == owner else f"owned by uid {got} on the host, not by the workspace's owner ({owner})"


def _over_quota(workspace: str) -> str | None:
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        size = overlay.tree_usage(fd)
    finally:
        os.close(fd)
    return None if size <= QUOTA_MB << 20 else f"the workspace holds {size >> 20} MiB, over the {QUOTA_MB} MiB quota"


def _shm_left(token: str) -> str | None:
    left = [n for n in os.listdir("/dev/shm") if token in n]
    return f"LEFT on the host: /dev/shm/{left[0]}" if left else None


def _processes_left(token: str, bound: float = 10.0) -> str | None:
    """Processes carrying ``token`` in their command line (waiting up to ``bound`` for the kill)."""
    import psutil

    deadline = time.monotonic() + bound
    while True:
        left = []
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if token in " ".join(p.info["cmdline"] or ()):
                    left.append(p.pid)
        if not left or time.monotonic() > deadline:
            return f"LEFT on the host: pids {left}" if left else None
        time.sleep(0.05)


class _Client:
    """The few protocol exchanges the selfcheck needs (``executor`` never imports the controller)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.pending: dict[str, Any] = {}

    def send(self, tool_name: str, kwargs: dict[str, Any], timeout: float = CALL_TIMEOUT) -> str:
        from protocol import Call, encode

        cid = uuid.uuid4().hex
        self.sock.send_multipart(encode(Call(id=cid, tool=tool_name, args=[], kwargs=kwargs, timeout=timeout)))
        return cid

    def wait(self, cid: str, bound: float) -> Any:
        from protocol import Result, decode

        deadline = time.monotonic() + bound
        while cid not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                if cid in self.pending:
                    break
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no answer to the selfcheck's call within {bound:g} s")
                continue
            msg = decode(self.sock.recv_multipart())
            if isinstance(msg, Result):
                self.pending[msg.id] = msg
        return self.pending.pop(cid)

    def call(self, tool_name: str, kwargs: dict[str, Any]) -> Any:
        return self.wait(self.send(tool_name, kwargs), CALL_TIMEOUT + 10)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _host_state() -> dict[str, Any]:
    """What an executor could leave behind on the host: mounts, groups, files in /dev/shm."""
    from executor.workers import cgroups

    groups = []
    for hierarchy in ("memory", "pids", "cpu", "unified"):
        base = cgroups.ROOT / hierarchy
        own = cgroups._own_path("" if hierarchy == "unified" else hierarchy)
        if own is not None:
            groups += [str(p) for p in (base / own.lstrip("/")).glob(f"{cgroups.PREFIX}*")]
    with open("/proc/self/mountinfo") as f:
        mounts = sorted(line.split()[4] for line in f)
    return {"mounts": mounts, "groups": sorted(groups), "shm": sorted(os.listdir("/dev/shm"))}


class Target:
    """A hardened executor serving the attempts, with what they aim at on the host: a workspace
    holding a root-only file, a socket directory, TCP and UDP listeners, a secret in the
    executor's environment, and a sibling worker busy with a long call. A context manager: on
    exit the executor is stopped and ``host_rows`` says what it left on the host."""

    def __init__(self, workers: int = 3, quiet: bool = True, extra: tuple[str, ...] = (),
                 workspace_owner: int | None = None, parent: str | None = None,
                 replace_template: bool = False) -> None:
        self.workers, self.quiet, self.extra, self.owner = workers, quiet, extra, workspace_owner
        self.replace_template = replace_template  # SIGKILL the first template: the attempts meet its replacement
        self.parent = parent or ("/var/tmp" if os.path.isdir("/var/tmp") else None)
        self.host_rows: list[Row] = []

    def __enter__(self) -> Target:
        import psutil

        self.before = _host_state()
        workspace = self._make_workspace()
        sockdir = os.path.join(self.top, "run")
        os.mkdir(sockdir, 0o700)
        sock_path = os.path.join(sockdir, "executor.sock")
        endpoint = f"ipc://{sock_path}"
        abstract_name = self._listen()
        secret = f"sk-{uuid.uuid4().hex}"
        cmd = [sys.executable, "-m", "executor.cli", "serve", "--profile", "hardened", "--skip-selfcheck",
               "--tools", "executor.sandbox.attempts", "--bind", endpoint, "--workers", str(self.workers),
               "--workspace", workspace, "--memory-mb", str(MEMORY_MB), "--max-processes", str(PROCESSES),
               "--timeout", "15", "--parent-pid", str(os.getpid()), "--log-level", "warning", *self.extra]
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, **{SECRET_ENV: secret}), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL if self.quiet else None, cwd=workspace)
        self.client: _Client | None = None
        self.ours: tuple[str, ...] = ()
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not os.path.exists(sock_path):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the hardened executor did not start (exit code {self.proc.poll()}); "
                                       f"run `ciayn-executor {' '.join(cmd[3:])}` to see why")
                time.sleep(0.02)
            self.client = _Client(endpoint)
            executor, template = self._serving_template(self.client, psutil)
            self.ours = (executor, f"-{template}-")  # in the names of its control groups
            self.client.send("hold", {"seconds": 300.0}, timeout=300.0)  # cancelled by the shutdown
            self.ctx = Context(endpoint=endpoint, sock_path=sock_path, workspace=workspace, supervisor=self.proc.pid,
                               template=template, sibling=(sibling := _busy_worker(template, psutil)),
                               keeper=_keeper_of(sibling, template, psutil), controller=os.getpid(),
                               tcp_port=self.tcp.getsockname()[1], udp_port=self.udp.getsockname()[1],
                               token=uuid.uuid4().hex[:12], secret=secret, abstract=abstract_name)
        except BaseException:
            self._stop()
            raise
        return self

    def _make_workspace(self) -> str:
        """The top directory (``self.top``) and, in it, the workspace holding a root-only file."""
        # Not under /tmp: Landlock rights go down a path, so a workspace under the sandbox's /tmp would
        # get /tmp's (sockets may be made there); a workspace is rarely under /tmp in CI.
        self.top = tempfile.mkdtemp(prefix="ciayn-selfcheck-", dir=self.parent)
        workspace = os.path.join(self.top, "workspace")
        os.mkdir(workspace)
        os.chmod(self.top, 0o755)
        with open(os.path.join(workspace, "root-only.txt"), "w") as f:
            f.write("root only")
        os.chmod(os.path.join(workspace, "root-only.txt"), 0o600)
        if self.owner is not None:
            os.chown(workspace, self.owner, self.owner)
        return workspace

    def _listen(self) -> str:
        """The host's listeners the attempts aim at: TCP, UDP and an abstract UNIX socket (its name)."""
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.setblocking(False)
        self.abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        abstract_name = f"ciayn-selfcheck-{uuid.uuid4().hex[:12]}"
        self.abstract.bind("\0" + abstract_name)
        self.abstract.listen()
        return abstract_name

    def _serving_template(self, client: _Client, psutil: Any) -> tuple[str, int]:
        """Once a first call was answered: the executor's id and its template's pid (with
        ``replace_template``, of the template that replaced the first, killed here)."""
        first = client.wait(client.send("hold", {"seconds": 0.0}), START_TIMEOUT)
        if not self.replace_template:
            tree = psutil.Process(self.proc.pid).children()
            return first.executor or "?", tree[0].pid if tree else 0
        old = psutil.Process(self.proc.pid).children()[0]
        old.kill()
        replaced_by = time.monotonic() + START_TIMEOUT
        while True:  # a call may still meet the old template's workers, or none: until one works
            first = client.wait(client.send("hold", {"seconds": 0.0}), START_TIMEOUT)
            # the replacement is a fresh interpreter; the old template's orphans may linger a while
            kids = [c.pid for c in psutil.Process(self.proc.pid).children() if _is_template_exec(c, psutil)]
            if first.ok and kids:
                return first.executor or "?", int(kids[0])
            if time.monotonic() > replaced_by:
                raise RuntimeError("the killed template was not replaced")
            time.sleep(0.05)

    def attempt(self, attempt: Attempt) -> Row:
        assert self.client is not None
        row = _run_attempt(self.client, attempt, self.ctx)
        if attempt.tool == "udp_send":
            got = b""
            with contextlib.suppress(BlockingIOError):
                got = self.udp.recv(256)
            if got:
                row.ok, row.observed = False, f"the host received {got!r}"
        return row

    def _stop(self) -> None:
        if self.client is not None:
            self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.tcp.close()
        self.udp.close()
        self.abstract.close()

    def __exit__(self, *exc: object) -> None:
        self._stop()
        ctx: Context | None = getattr(self, "ctx", None)
        self.host_rows = _host_rows(self.before, ctx.token if ctx else "-", self.ours)
        shutil.rmtree(self.top, ignore_errors=True)


RW_EXTRA = ("--workspace-rw", "--workspace-quota", str(QUOTA_MB))  # the executor under test with --workspace-rw


def attempts(workspace_rw: bool = False) -> list[Attempt]:
    """The attempts for a read-only workspace, or for ``--workspace-rw``."""
    skip = "ro" if workspace_rw else "rw"
    return [a for a in ATTEMPTS if a.mode != skip]


def run(quiet: bool = True, workspace_rw: bool = False) -> list[Row]:
    """Start a hardened executor serving the attempts, run every attempt, stop it, and check the
    host. Returns one row per attempt, then the host checks."""
    with Target(quiet=quiet, extra=RW_EXTRA if workspace_rw else ()) as target:
        rows = [target.attempt(a) for a in attempts(workspace_rw)]
    return rows + target.host_rows


def _busy_worker(template: int, psutil: Any) -> int:
    """The host pid of the worker running the long ``hold`` call (the sibling whose call the others
    attack): the one asleep in nanosleep, where idle workers wait on their channel. (With
    --workspace-rw the template's child is the call's keeper, and the call runs in its child.)"""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            children = psutil.Process(template).children(recursive=True)
        except psutil.NoSuchProcess:
            raise RuntimeError(f"the template ({template}) is gone before the selfcheck's long call started") from None
        for child in children:
            with contextlib.suppress(OSError, psutil.Error), open(f"/proc/{child.pid}/wchan") as f:
                if "nanosleep" in f.read():
                    return int(child.pid)
        time.sleep(0.02)
    raise RuntimeError("the selfcheck's long call did not start in a worker within 10 s")


def _is_template_exec(process: Any, psutil: Any) -> bool:
    """Whether ``process`` is a template started as a fresh interpreter (``-m executor.workers.template``)."""
    try:
        return "executor.workers.template" in process.cmdline()
    except psutil.Error:
        return False


def _keeper_of(worker: int, template: int, psutil: Any) -> int:
    """The keeper of a --workspace-rw worker (its parent, a child of the template), else 0."""
    parent = psutil.Process(worker).ppid()
    return parent if parent != template else 0


def _run_attempt(client: _Client, attempt: Attempt, ctx: Context) -> Row:
    row = Row(attempt.layer, attempt.name, attempt.expected)
    try:
        result = client.call(attempt.tool, attempt.args(ctx))
    except (TimeoutError, OSError) as e:
        row.observed = f"no answer: {e}"
        return row
    if attempt.error_kind is not None:
        kind = result.error.kind if result.error else None
        row.ok = kind == attempt.error_kind
        row.observed = f"error {kind}: {result.error.message}" if result.error else f"ALLOWED: {result.value!r}"
    elif result.error is not None:
        tail = result.stderr.strip().splitlines()[-1:] if result.stderr else []
        row.observed = f"the call failed: {result.error.kind}: {result.error.message} {' '.join(tail)}"[:300]
    else:
        row.ok = bool(attempt.judge(result.value))
        row.observed = json.dumps(result.value)[:300]
    if attempt.host_check is not None and (left := attempt.host_check(ctx)):
        row.ok, row.observed = False, left
    return row


def _host_rows(before: dict[str, Any], token: str, ours: tuple[str, ...]) -> list[Row]:
    """After the executor stopped: nothing of it may remain on the host (bounded wait for the
    kernel to finish tearing down what it killed). Its groups are those whose names hold its id
    (memory, pids, kill) or its template's pid (CPU): other executors may run meanwhile."""
    deadline = time.monotonic() + 10
    while True:
        after = _host_state()
        leftovers = {
            "processes": [_processes_left(token, 0)] if _processes_left(token, 0) else [],
            "mounts": sorted(set(after["mounts"]) - set(before["mounts"])),
            "groups": sorted(g for g in set(after["groups"]) - set(before["groups"]) if any(o in g for o in ours)),
            "shm": sorted(set(after["shm"]) - set(before["shm"])),
        }
        if not any(leftovers.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    rows = []
    for what, layer in (("processes", "pid-ns, cgroups"), ("mounts", "mount-ns"), ("groups", "cgroups"),
                        ("shm", "filesystem")):
        left = leftovers[what]
        rows.append(Row(layer, f"host after exit: no {what} left", "none",
                        "none" if not left else f"LEFT: {left[:5]}", not left))
    return rows


def format_table(rows: list[Row]) -> str:
    widths = [max(len(getattr(r, k)) for r in rows) for k in ("layer", "attempt", "expected")]
    widths = [min(w, 60) for w in widths]
    lines = [f"{'layer':<{widths[0]}}  {'attempt':<{widths[1]}}  {'expected':<{widths[2]}}  observed"]
    for r in rows:
        mark = "ok  " if r.ok else "FAIL"
        lines.append(f"{r.layer:<{widths[0]}}  {r.attempt:<{widths[1]}}  {r.expected:<{widths[2]}}  "
                     f"{mark} {r.observed}")
    failed = sum(1 for r in rows if not r.ok)
    lines.append(f"{len(rows) - failed} of {len(rows)} attempts denied" + (f"; {failed} FAILED" if failed else ""))
    return "\n".join(lines)


def main(as_json: bool = False, quiet: bool = True, workspace_rw: bool = False) -> int:
    """``ciayn-executor selfcheck``: 0 only when every attempt was denied; 2 when the machine
    lacks layers (named)."""
    missing = layers.probe_all()
    if missing:
        text = "; ".join(f"{k}: {v}" for k, v in missing.items())
        if as_json:
            print(json.dumps({"ok": False, "missing_layers": missing, "rows": []}))
        else:
            print(f"ciayn-executor selfcheck: this machine cannot give these layers: {text}", file=sys.stderr)
        return 2
    try:
        rows = run(quiet=quiet, workspace_rw=workspace_rw)
    except RuntimeError as e:
        print(f"ciayn-executor selfcheck: {e}", file=sys.stderr)
        return 1
    ok = all(r.ok for r in rows)
    if as_json:
        print(json.dumps({"ok": ok, "rows": [asdict(r) for r in rows]}, indent=1))
    else:
        print(format_table(rows))
    return 0 if ok else 1
