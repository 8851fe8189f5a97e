"""Red team of the default profile's PID namespace (``executor.workers.pidns``: 9fb2bb4, 2b3945c, 81a4988).

The claim: a tool (hostile code in a worker, of the executor's uid, root on CI) cannot signal, stop,
trace or otherwise bring down the supervisor, the controller or the template, cannot see processes
outside the namespace, starts nothing that outlives the template, and the executor keeps serving.
Each test runs one attack of ``tests/tools/pidns_attacks.py`` against a real executor and judges
from the host. Two ways into the namespace are attacked: the root way (the supervisor unshares
CLONE_NEWPID) and the user-namespace way (``userns``: root with CAP_SYS_ADMIN dropped from the
bounding set takes it, as any other user does).

A test marked ``xfail(strict=True, reason="HOLE: ...")`` is an attack that succeeds on the current
code: the reason says how; the day the hole is closed it XPASSes and the mark must go. The others
hold and cover what ``test_attacks.py`` does not.

Every test cleans up after itself and checks it did (``served``): no process of its executors or of
their namespaces is left, no control group it made, no new mount under the host's ``/proc``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import psutil
import pytest

from controller import ExecutorClient, ExecutorUnavailable, LocalExecutor
from controller.local import executor_environment
from executor.slot import RETIRE_GRACE
from executor.status import fetch
from executor.workers.cgroups import CgroupSupport
from protocol import Call, Result
from tests.conftest import TESTS, host_pid, nspid, pid_namespaces, require_layer
from tests.support.waiting import START_BOUND, wait_until

PIDNS = str(TESTS / "tools" / "pidns_attacks.py")
ROOT = TESTS.parent
TIMEOUT = 5.0  # the executors' wall-clock limit
GRACE = 1.5  # how late after its bound something may happen on a loaded 2-core machine
HOST_PIDNS = os.readlink("/proc/self/ns/pid")
CGROUP = Path("/sys/fs/cgroup")
V2 = CGROUP / "unified" if (CGROUP / "unified" / "cgroup.procs").exists() else CGROUP
FREEZER = CGROUP / "freezer"
MARK = "pidns-redteam-"  # the tools' TEST_GROUP_MARK: only groups so named may be killed or frozen
PR_CAPBSET_DROP = 24
CAP_SYS_ADMIN = 21
PATHS = ["root", "userns"]


# ------------------------------------------------------------------------------------------ helpers


def _proc_mounts() -> set[str]:
    """The host's mount points at or under /proc (an attack mounts only in the template's namespace)."""
    with open("/proc/self/mountinfo") as f:
        return {fields[4] for fields in map(str.split, f) if fields[4] == "/proc" or fields[4].startswith("/proc/")}


def _namespace_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def _in_namespaces(namespaces: set[str]) -> list[int]:
    """Host pids of the live processes in any of ``namespaces`` (zombies are on their way out)."""
    found = []
    for pid in psutil.pids():
        if _namespace_of(pid) in namespaces:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    found.append(pid)
    return found


def _running_our_tools() -> list[int]:
    """Host pids of processes started with our tool module (supervisors, their forked templates and
    workers, those of a controller the test ran as its own process)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if PIDNS in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p.pid)
    return found


def _template(local: LocalExecutor) -> int:
    """The host pid of the executor's template: the process under the supervisor (its child, or its
    relay's) that is PID 1 of its namespace; 0 if none."""
    assert local.proc is not None
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in psutil.Process(local.proc.pid).children(recursive=True):
            if nspid(p.pid)[1:] == [1]:
                return int(p.pid)
    return 0


def _answers(client: ExecutorClient) -> bool:
    try:
        client.tools(timeout=0.5)
    except ExecutorUnavailable:
        return False
    return True


class Served:
    """The executors a test started, the PID namespaces their templates had, their ids (which name
    their workers' control groups) and the control groups the test made for them."""

    def __init__(self) -> None:
        self.executors: list[LocalExecutor] = []
        self.namespaces: set[str] = set()
        self.pins: list[int] = []  # a descriptor on each noted namespace: its number is not reused
        self.ids: set[str] = set()
        self.groups: list[Path] = []

    def note(self, local: LocalExecutor) -> None:
        """Remember the PID namespaces under this executor now (a replaced template has a new one).

        Each is held open until the clean-up: the kernel gives a dead namespace's number to the next
        one made, and a parallel test's executor in it would look like a process of ours left behind."""
        assert local.proc is not None
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in psutil.Process(local.proc.pid).children(recursive=True):
                try:
                    fd = os.open(f"/proc/{p.pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
                ns = os.readlink(f"/proc/self/fd/{fd}")
                if ns != HOST_PIDNS and ns not in self.namespaces:
                    self.namespaces.add(ns)
                    self.pins.append(fd)
                else:
                    os.close(fd)

    def group(self, hierarchy: Path) -> Path:
        group = hierarchy / f"{MARK}{uuid.uuid4().hex[:8]}"
        group.mkdir()
        self.groups.append(group)
        return group

    def start(self, *, path: str = "root", group: Path | None = None, **options: Any) -> LocalExecutor:
        """``ciayn-executor serve`` as ``LocalExecutor`` starts it (its command line and environment),
        in ``group`` (a control group directory) if given, and without CAP_SYS_ADMIN for ``userns``."""
        if os.geteuid() != 0:
            pytest.skip("the attacks and their checks from the host need root")

        def preexec() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            if group is not None:
                fd = os.open(group / "cgroup.procs", os.O_WRONLY)
                os.write(fd, b"0")
                os.close(fd)
            if path == "userns" and libc.prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN)")

        local = LocalExecutor(tools=[PIDNS], timeout=TIMEOUT, **options)
        local.dir = Path(tempfile.mkdtemp(prefix="ciayn-pidns-redteam-"))
        self.executors.append(local)
        with open(local.log_path, "wb") as log:
            local.proc = subprocess.Popen(local.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                          env=executor_environment(()), preexec_fn=preexec, start_new_session=True)
        client = local.client = ExecutorClient(local.endpoint, connect_timeout=0.5)
        wait_until(f"the executor to answer\n{local.log_tail()}",
                   lambda: local.proc is not None and (local.proc.poll() is not None or _answers(client)),
                   timeout=START_BOUND)
        assert local.proc.poll() is None, f"the executor exited\n{local.log_tail()}"
        client.connect_timeout = 10.0
        up = client.call(Call(tool="echo", args=["up"]))
        assert up.ok and up.executor, up
        self.ids.add(up.executor)
        self.note(local)
        template = _template(local)
        assert template, f"the premise: the template is PID 1 of its namespace ({path})\n{local.log_tail()}"
        relay = psutil.Process(template).ppid() != local.proc.pid
        assert relay == (path == "userns"), f"the premise: a relay between supervisor and template ({path}) or not"
        return local

    def clean_up(self) -> None:
        """Thaw what a test froze, stop every executor, then check nothing is left and remove the
        control groups (the test's and the executors' workers' that a killed executor left)."""
        for group in self.groups:
            with contextlib.suppress(OSError):
                if (group / "freezer.state").exists():
                    (group / "freezer.state").write_text("THAWED")
                if (group / "cgroup.freeze").exists():
                    (group / "cgroup.freeze").write_text("0")
        for local in self.executors:
            if local.proc is not None and local.proc.poll() is None:
                self.note(local)
            local.stop()
        try:
            wait_until("every process of the test's executors and their namespaces to be gone",
                       lambda: not _running_our_tools() and not _in_namespaces(self.namespaces), timeout=10)
        finally:
            for fd in self.pins:
                os.close(fd)
            self._remove_groups()

    def _remove_groups(self) -> None:
        support = CgroupSupport.detect()
        for executor_id in self.ids:
            if support is not None:
                support.remove_named(f"{executor_id}-", wait=2.0)
        for group in self.groups:
            for sub in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                _rmdir(sub)
            _rmdir(group)
        left = [str(g) for g in self.groups if g.exists()]
        assert not left, f"control groups left: {left}"


def _rmdir(group: Path) -> None:
    deadline = time.monotonic() + 5
    while group.exists():
        try:
            group.rmdir()
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)


@pytest.fixture
def served() -> Iterator[Served]:
    """Start executors with ``served.start(path=..., group=..., **options)``; all is stopped, checked
    and removed at the end."""
    require_layer(pid_namespaces(), "workers share the executor's PID namespace here (it takes root)")
    mounts = _proc_mounts()
    served = Served()
    yield served
    served.clean_up()
    assert _proc_mounts() == mounts, f"mounts under the host's /proc changed: {_proc_mounts() ^ mounts}"


def call(local: LocalExecutor, tool: str, timeout: float | None = None, **kwargs: Any) -> Result:
    assert local.client is not None
    return local.client.call(Call(tool=tool, kwargs=kwargs), timeout=timeout)


def serving(local: LocalExecutor) -> bool:
    """Whether the executor still runs and answers a call at once."""
    if local.proc is None or local.proc.poll() is not None:
        return False
    r = call(local, "echo", timeout=2.0, value="still there")
    return r.ok and r.value == "still there"


# --------------------------------------------------------- the namespace's /proc, in a shared mount namespace


# Closed (was: as root the workers shared the template's mount namespace holding CAP_SYS_ADMIN, so a tool
# could umount2('/proc', MNT_DETACH) the namespace's /proc and see the host's below it, for every later
# call too; it read a dumpable controller's API keys there, left processes the sweeps could no longer
# name, bound a fake /proc/1/stat that made every later worker refuse its call, rebooted the namespace
# (killing the template), loaded BPF that killed the supervisor or denied devices to its group, and
# opened core_pattern. Root workers now drop CAP_SYS_ADMIN, CAP_SYS_BOOT, CAP_BPF and the rest of
# privacy.HOST_ADMIN_CAPS, and the template's /proc/sys is read-only.)


def test_a_root_tool_cannot_take_the_namespaces_proc_away(served: Served) -> None:
    local = served.start()
    attack = call(local, "unmount_proc")
    later = call(local, "view")
    assert later.ok and later.value["self"] == later.value["getpid"], (
        f"a later call's /proc is the host's: it shows {later.value['count']} processes")
    assert not (attack.ok and attack.value["host_proc"]), (
        f"the tool saw {attack.value['count']} host processes and its ancestors {attack.value['names']} "
        f"{attack.value['ancestors']}")


SECRET = "sk-pidns-redteam-0penai"
CONTROLLER = """
import json, sys
from controller import LocalExecutor
from protocol import Call
with LocalExecutor(tools=[sys.argv[1]], timeout=5) as client:
    r = client.call(Call(tool="controller_environment", kwargs={"levels": 3}))
    print(json.dumps({"ok": r.ok, "value": r.value, "error": str(r.error)}))
"""


def test_a_root_tool_cannot_read_the_controllers_api_keys(served: Served) -> None:
    """The controller is a process of its own here (as ``ciayn run`` is), with an API key in its
    environment, which ``LocalExecutor`` keeps from the executor it starts."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    env = {**os.environ, "OPENAI_API_KEY": SECRET}
    done = subprocess.run([sys.executable, "-c", CONTROLLER, PIDNS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    seen = [line for line in str(result["value"]).splitlines() if SECRET in line]
    assert not seen, f"the tool read the controller's environment, key included: {seen}"


@pytest.mark.parametrize("unmount", [False, True])
def test_a_process_a_root_tool_leaves_does_not_outlive_its_call(served: Served, unmount: bool) -> None:
    """Out of the worker's control groups (so no group kill reaches it), a child is still the
    worker's and then the template's to kill, as long as they read their namespace's /proc."""
    local = served.start()
    assert local.proc is not None
    left = call(local, "leave_a_process", seconds=30.0, unmount=unmount)
    assert left.ok, left.error
    wait_until(f"the process the call left (pid {left.value} in the namespace) to be killed",
               lambda: not host_pid(local.proc.pid, left.value), timeout=RETIRE_GRACE + GRACE)  # type: ignore[union-attr]
    assert serving(local)


def test_a_root_tool_cannot_make_every_later_worker_refuse_its_call(served: Served) -> None:
    local = served.start()
    faked = call(local, "fake_dying_template")
    assert faked.ok or (faked.error is not None and "not permitted" in faked.error.message), faked.error
    after = [call(local, "echo", timeout=2.0, value=i) for i in range(2)]
    assert all(r.ok for r in after), f"later calls: {[r.error for r in after]}"


# ------------------------------------------------------------------------- not through pid numbers


def test_a_root_tool_cannot_kill_the_template_by_restarting_its_namespace(served: Served) -> None:
    local = served.start(workers=2)
    assert local.proc is not None and local.client is not None
    template = _template(local)
    other: Future[Result] = local.client.submit(Call(tool="nap", kwargs={"seconds": 1.5}))
    wait_until("the other client's call to run on the second worker", lambda: fetch(local.endpoint).busy == 1,
               START_BOUND)
    attack = call(local, "reboot_namespace", host_pidns=HOST_PIDNS)
    bystander = other.result(timeout=TIMEOUT + GRACE)
    served.note(local)
    assert _template(local) == template, f"the template was killed ({attack.error})"
    assert bystander.ok, f"another client's call: {bystander.error}"


def test_a_root_tool_cannot_kill_the_supervisor_with_bpf(served: Served) -> None:
    local = served.start()
    assert local.proc is not None
    attack = call(local, "bpf_kill", timeout=3.0, pid=local.proc.pid, hold=1.0)
    if attack.ok and attack.value.startswith("BPF_") and "not permitted" not in attack.value:
        pytest.skip(f"this kernel offers no BPF raw tracepoints with bpf_send_signal: {attack.value}")
    with contextlib.suppress(subprocess.TimeoutExpired):
        local.proc.wait(0.5)
    assert local.proc.poll() is None, f"the supervisor died ({local.proc.returncode}); the tool said {attack}"


# --------------------------------------------------------------------------------- control groups


def _group_hole(what: str) -> str:
    return (f"HOLE (default profile as root; README: a root tool can write any root-owned file, the executor's "
            f"own code and control groups included; the hardened profile runs tools as another uid): {what}: "
            "the executor runs in a control group of its own (a service's, a CI job's; here one the "
            "test made) and its workers' groups are made under it; a worker running as uid 0 (root, or root "
            "without CAP_SYS_ADMIN in its user namespace, where uid 0 is mapped to the host's 0 and cgroup "
            "files are the owner's to write) reads its group in /proc/self/cgroup and writes the parent's control "
            "file. The kernel acts on the group's processes whatever PID namespace they are in")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.xfail(strict=True, reason=_group_hole("SUPERVISOR KILLED by cgroup.kill of the executor's v2 group "
                                                   "(pidns_attacks.kill_executor_group)"))
def test_a_tool_cannot_kill_the_executors_control_group(served: Served, path: str) -> None:
    if not (V2 / "cgroup.procs").exists():
        pytest.skip("no cgroup v2 hierarchy")
    local = served.start(path=path, group=served.group(V2))
    assert local.proc is not None
    attack = call(local, "kill_executor_group", timeout=3.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        local.proc.wait(0.5)
    assert local.proc.poll() is None, f"the supervisor died ({local.proc.returncode}); the tool said {attack}"


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.xfail(strict=True, reason=_group_hole("SUPERVISOR FROZEN (the executor stops serving until someone "
                                                   "thaws it) by freezing the executor's group: v2 cgroup.freeze, "
                                                   "v1 freezer.state (pidns_attacks.freeze_executor_group)"))
def test_a_tool_cannot_freeze_the_executors_control_group(served: Served, path: str, version: int) -> None:
    hierarchy = V2 if version == 2 else FREEZER
    if not (hierarchy / "cgroup.procs").exists():
        pytest.skip(f"no cgroup v{version} freezer here")
    local = served.start(path=path, group=served.group(hierarchy))
    call(local, "freeze_executor_group", timeout=2.0, version=version)
    assert serving(local), "the executor does not answer: it is frozen"


def _join(group: Path) -> Callable[[], None]:
    def preexec() -> None:
        fd = os.open(group / "cgroup.procs", os.O_WRONLY)
        os.write(fd, b"0")
        os.close(fd)
    return preexec


def test_nothing_a_root_tool_attaches_to_the_executors_group_outlives_it(served: Served) -> None:
    if not (V2 / "cgroup.procs").exists():
        pytest.skip("no cgroup v2 hierarchy")
    group = served.group(V2)
    local = served.start(group=group)
    attack = call(local, "deny_devices_to_executor_group", timeout=4.0)
    assert attack.ok, attack.error
    if attack.value != "attached" and "not permitted" not in attack.value:
        pytest.skip(f"this kernel offers no cgroup device programs: {attack.value}")
    still = serving(local) and serving(local)  # (the worker forked ahead opened /dev/null before)
    local.stop()
    later = subprocess.run([sys.executable, "-c", "open('/dev/null').close()"], preexec_fn=_join(group),
                           capture_output=True, text=True, timeout=60)
    assert still and later.returncode == 0, (
        f"the executor serves: {still}; a process started in its group after it: {later.stderr.strip()[-200:]}")


@pytest.mark.parametrize("path", PATHS)
def test_a_tool_cannot_open_the_kernels_core_pattern_for_writing(served: Served, path: str) -> None:
    local = served.start(path=path)
    tried = call(local, "open_core_pattern")
    assert tried.ok, tried.error
    assert tried.value.startswith("refused"), tried.value


# ---------------------------------------------------------------------------------------- what held


@pytest.mark.parametrize("path", PATHS)
def test_a_tool_gets_no_handle_on_the_template_or_the_supervisor(served: Served, path: str) -> None:
    """Beyond ``kill``, ``pidfd_open`` and ``/proc/PID`` (``test_attacks``): a socket's owner for SIGIO
    (``F_SETOWN``, a process or its group), its priority, CPU affinity, process group and session all
    resolve the supervisor's pid in the tool's namespace, where it names nothing. And the template,
    the one process outside the tool's reach that it can name (PID 1), is not dumpable and the
    worker holds no CAP_SYS_PTRACE: its descriptors (the channel to the supervisor, the wake-up pipe
    of its loop), directories, executable and memory are refused, and so is ``pidfd_getfd``."""
    local = served.start(path=path)
    assert local.proc is not None
    by_pid = call(local, "signal_by_number", pid=local.proc.pid)
    assert by_pid.ok, by_pid.error
    assert set(by_pid.value.values()) == {"ESRCH"}, by_pid.value
    handles = call(local, "template_handles")
    assert handles.ok, handles.error
    assert set(handles.value.values()) <= {"EACCES", "EPERM"}, handles.value
    assert serving(local)


def test_in_a_user_namespace_a_tool_cannot_regain_rights_over_its_templates_namespaces(served: Served) -> None:
    """The user-namespace way (root without CAP_SYS_ADMIN here): the template dropped every
    capability, the bounding set included, before forking the worker. So the worker cannot unmount
    or mount over /proc, restart its namespace (reboot), load BPF, or get a capability back by
    executing a program as uid 0; in a user namespace of its own (which any process may make) it has
    every capability, but only over namespaces that user namespace owns: the mounts it inherited
    are locked, and the PID namespace is its template's."""
    local = served.start(path="userns")
    tried = call(local, "regain_privileges", timeout=30.0, host_pidns=HOST_PIDNS)
    assert tried.ok, tried.error
    got = tried.value
    for way in ("umount", "mount_tmpfs", "mount_proc", "reboot"):
        assert got[way] in ("EPERM", "EACCES"), f"{way}: {got[way]}"
    assert got["bpf"].startswith("BPF_PROG_LOAD: "), got["bpf"]
    assert int(got["exec_capeff"], 16) == 0, f"a program executed as uid 0 holds capabilities {got['exec_capeff']}"
    nested = got["nested"]
    if nested.get("unshare") == "ok":
        assert nested["umount"] in ("EINVAL", "EPERM"), f"the inherited /proc mount was not locked: {nested}"
        assert nested["mount_proc"] == "EPERM", nested
    assert nested["still_ns_proc"] == "True", nested
    later = call(local, "view")
    assert later.ok and later.value["self"] == later.value["getpid"], later.value
    assert serving(local)
