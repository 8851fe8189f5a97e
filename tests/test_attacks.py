"""The attack suite: tools written to escape or sabotage the executor (``tests/tools/attacks.py``),
each run in a real executor on a real ipc socket.

Every finding of issue 9 is an attack here: replies forged on the worker's channel, patched
registries, threads and alarms left for the next call, inherited descriptors, secrets, a killed,
stopped or frozen template, unkillable workers and children, lifted limits, ``CLONE_PARENT``
children, oversized errors and signals, floods on the channel. So are the attacks found while
writing them: on the workers forked ahead for later calls (stopped, their channels taken), on the
template's memory and channel, on secrets left in a worker's memory, with processes that never keep
a pid, a tool that ignores SIGXCPU, and one that holds every worker. After each attack the executor must
still answer a ping at once, its process tree must be exactly supervisor, template and worker
(nothing the attack started), and the supervisor's peak RSS must stay under ``SUPERVISOR_PEAK_MB``.

The second part proves each defense layer on its own, so that one broken layer cannot hide behind
another: tools get stdin at EOF from an executor started with an open stdin pipe, memory limits
hold with ``--no-cgroups`` (``RLIMIT_DATA`` alone), and exactly one group exists per live worker
after crashes. Where a layer is missing, ``require_layer`` skips, except on CI (root, cgroups,
``CI=true``), where it fails.

A test marked ``xfail(strict=True, reason="HOLE: ...")`` is an attack that succeeds on the current
code: it documents the hole and turns into a failure (XPASS) the day the hole is closed, when the
mark must go.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from controller import ExecutorClient, LocalExecutor
from executor.keeper import KILL_GRACE
from executor.slot import RETIRE_GRACE, TEMPLATE_ANSWER_TIMEOUT
from executor.workers.cgroups import CgroupSupport
from protocol import Call, Result, encode
from protocol.environment import ALWAYS, ALWAYS_PREFIXES
from tests.conftest import host_pid, nspid, pid_namespaces, require_layer, template_of
from tests.support.attacks import ATTACKS, TIMEOUT, start_raw
from tests.support.attacks import start as _start
from tests.support.processes import alive as _alive
from tests.support.processes import assert_tree_is_supervisor_template_and
from tests.support.waiting import wait_until
from tests.support.wire import Wire

__all__ = ["start_raw"]  # a fixture, used by name

GRACE = 1.5  # how late after its bound an answer may come, on a loaded 2-core machine
# What a new template (a fresh interpreter importing the tools) may take to fork its first worker on
# a loaded 2-core machine: under 1 s alone, but a fresh-clone CI run once took over 2.7 s.
NEW_TEMPLATE = 4.0
SUPERVISOR_PEAK_MB = 100  # issue 9: the supervisor stays under this through the whole suite
SECRETS = {"OPENAI_API_KEY": "sk-attack-0penai", "AWS_SECRET_ACCESS_KEY": "aws-attack-secret",
           "GITHUB_TOKEN": "ghp_attack_token"}
FREEZER = Path("/sys/fs/cgroup/freezer")
PR_CAPBSET_DROP = 24
CAP_SYS_RESOURCE = 24


# ------------------------------------------------------------------------------------------ helpers


def supervisor_peak_mb(local: LocalExecutor) -> float:
    """The supervisor's peak resident set (VmHWM): it catches a spike that was freed again."""
    assert local.proc is not None
    with open(f"/proc/{local.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in the supervisor's status")


def held(local: LocalExecutor, worker_pid: int | None = None) -> None:
    """After an attack: the executor runs and answers a ping at once, its tree is supervisor,
    template and one worker (``worker_pid`` for a reused one), and the supervisor stayed small."""
    assert local.proc is not None and local.proc.poll() is None, f"the executor exited\n{local.log_tail()}"
    wire = Wire(local.endpoint)
    try:
        wire.ping(within=1.0)
    finally:
        wire.close()
    assert_tree_is_supervisor_template_and(local, worker_pid)
    peak = supervisor_peak_mb(local)
    assert peak < SUPERVISOR_PEAK_MB, f"the supervisor's RSS peaked at {peak:.0f} MB"


def timed(client: ExecutorClient, tool: str, timeout: float | None = None, **kwargs: Any) -> tuple[Result, float]:
    started = time.monotonic()
    result = client.call(Call(tool=tool, kwargs=kwargs), timeout=timeout)
    return result, time.monotonic() - started


@pytest.fixture(scope="module")
def executor() -> Iterator[LocalExecutor]:
    """One executor with default options (a fresh worker per call, one worker) that every attack in
    the first part of the module hits in turn: it must hold through all of them."""
    local = _start()
    yield local
    local.stop()


@pytest.fixture
def client(executor: LocalExecutor) -> ExecutorClient:
    assert executor.client is not None
    return executor.client


@pytest.fixture
def freezer() -> Iterator[Path]:
    """A v1 freezer group for the test: a task frozen in it ignores SIGKILL until thawed, as a task
    in uninterruptible sleep does. Thawed, emptied and removed at the end (before the executors the
    test started are stopped: request this fixture after ``make_client``)."""
    if os.geteuid() != 0 or not (FREEZER / "cgroup.procs").exists():
        pytest.skip("needs root and the v1 freezer hierarchy to make a process that SIGKILL cannot stop")
    group = FREEZER / f"ciayn-attack-{uuid.uuid4().hex[:8]}"
    yield group
    if group.exists():
        thaw(group)
        wait_until("the frozen processes to exit once thawed",
                   lambda: not (group / "cgroup.procs").read_text().split(), timeout=10)
        group.rmdir()


def thaw(group: Path) -> None:
    (group / "freezer.state").write_text("THAWED")


def _drop_cap_sys_resource() -> None:
    """preexec_fn: drop CAP_SYS_RESOURCE from the bounding set, so the executor (even as root) runs
    without the capability that lets a process raise its hard limits."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_SYS_RESOURCE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_SYS_RESOURCE)")


# ----------------------------------------------------------------- calls do not leak into later calls


def test_a_tool_that_forges_its_reply_and_stays_never_sees_or_answers_a_later_call(
    executor: LocalExecutor, client: ExecutorClient, tmp_path: Path
) -> None:
    seen = tmp_path / "requests-the-squatter-read.log"
    forged = client.call(Call(tool="forge_reply_then_serve", kwargs={"log": str(seen), "seconds": 30}))
    # The supervisor takes the forgery as the tool's own result (its own to make), or sees through it.
    assert forged.value == "forged" or (forged.error is not None and forged.error.kind == "crashed"), forged
    assert forged.worker is not None
    squatter = forged.worker.pid
    # Its own call may carry its forgery (that result is the tool's to make); no other call may.
    for i in range(5):
        r = client.call(Call(tool="echo", args=[f"innocent {i}"]))
        assert r.ok and r.value == f"innocent {i}", r
        assert r.worker is not None and r.worker.pid != squatter
    assert not seen.exists(), f"the squatting tool read later requests: {seen.read_text()!r}"
    wait_until("the squatting worker to be killed", lambda: not _alive(squatter), timeout=RETIRE_GRACE + GRACE)
    held(executor)


def test_a_tool_that_patches_the_registry_changes_no_later_call(
    executor: LocalExecutor, client: ExecutorClient
) -> None:
    patched = client.call(Call(tool="patch_registry"))
    assert patched.ok and patched.value > 0, patched  # it did rewrite the registry of its own process
    for i in range(3):
        r = client.call(Call(tool="echo", args=[i]))
        assert r.ok and r.value == i, f"a later call returned the patch's value: {r}"
    assert isinstance(client.call(Call(tool="whoami")).value, dict)
    held(executor)


def test_a_tool_cannot_rewrite_the_template_that_later_workers_are_forked_from(
    make_client: Callable[..., ExecutorClient],
) -> None:
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT)
    assert client.call(Call(tool="greet", args=["0"])).value == "greeting-from-the-template:0"
    patched = client.call(Call(tool="patch_template"))
    assert patched.ok or patched.error is not None
    for i in range(1, 4):  # the first may run on a worker forked before the attack
        r = client.call(Call(tool="greet", args=[str(i)]))
        assert r.value == f"greeting-from-the-template:{i}", f"a later call runs the attacker's template: {r.value!r}"


def test_a_thread_left_running_writes_nothing_into_the_next_call(
    executor: LocalExecutor, client: ExecutorClient
) -> None:
    left = client.call(Call(tool="leave_thread", kwargs={"delay": 0.3, "kb": 4096}))
    assert left.ok, left.error
    after = client.call(Call(tool="nap", kwargs={"seconds": 1.0}))  # the thread would fire during this call
    assert after.ok, f"the next call was blamed for the thread's output: {after.error}"
    assert after.stdout == "" and after.worker is not None and not after.worker.restarted
    held(executor)


def test_an_alarm_armed_for_the_next_call_never_fires_in_it(executor: LocalExecutor, client: ExecutorClient) -> None:
    assert client.call(Call(tool="arm_alarm", kwargs={"seconds": 1})).ok
    after = client.call(Call(tool="nap", kwargs={"seconds": 1.5}))
    assert after.ok, f"the innocent call died of the alarm: {after.error}"
    held(executor)


def test_a_tool_cannot_take_over_the_workers_forked_for_later_calls(
    make_client: Callable[..., ExecutorClient], tmp_path: Path
) -> None:
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT, workers=2)
    seen = tmp_path / "requests-the-hijacker-read.log"
    attack = client.call(Call(tool="hijack_next_worker", kwargs={"log": str(seen), "seconds": 2.0}))
    assert attack.ok or attack.error is not None
    for i in range(3):
        r = client.call(Call(tool="echo", args=[f"innocent {i}"]))
        assert r.ok and r.value == f"innocent {i}", f"a later call was answered by the attacker: {r}"
    assert not seen.exists(), f"the attacker read later requests: {seen.read_text()!r}"


def test_stopping_the_workers_forked_for_later_calls_costs_no_later_call(
    make_client: Callable[..., ExecutorClient],
) -> None:
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT, workers=2)

    def stopped_some() -> list[int]:  # the premise: workers forked ahead to stop (the first call of a
        r = client.call(Call(tool="stop_next_workers"))  # new executor may come before the second is forked)
        assert r.ok, r
        return r.value  # type: ignore[return-value]

    wait_until("a call that finds workers forked ahead to stop", stopped_some, timeout=20)
    for i in range(2):
        r = client.call(Call(tool="echo", args=[i]))
        assert r.ok and r.value == i, f"an innocent call paid for the attack: {r.error}"


# --------------------------------------------------------------------------------- inherited handles


def _descriptors(client: ExecutorClient) -> dict[int, dict[str, Any]]:
    r = client.call(Call(tool="open_fds"))
    assert r.ok, r.error
    return {entry["fd"]: entry for entry in r.value}


def test_a_worker_holds_only_stdin_stdout_stderr_and_its_channel(
    executor: LocalExecutor, client: ExecutorClient
) -> None:
    fds = _descriptors(client)
    sockets = [fd for fd, entry in fds.items() if entry["socket"]]
    assert len(sockets) == 1, f"expected one socket (the channel): {fds}"
    assert set(fds) == {0, 1, 2, sockets[0]}, f"descriptors beyond 0, 1, 2 and the channel: {fds}"
    assert fds[0]["target"] == "/dev/null" and fds[0]["chr"]
    assert fds[1]["fifo"] and fds[2]["fifo"]
    held(executor)


def test_the_controllers_pidfd_is_not_inherited(executor: LocalExecutor, client: ExecutorClient) -> None:
    assert "--parent-pid" in executor.command(), "the executor watches its controller through a pidfd"
    assert all(entry["target"] != "anon_inode:[pidfd]" for entry in _descriptors(client).values())
    hits = client.call(Call(tool="signal_through_pidfds"))
    assert hits.ok and hits.value == [], f"a tool could signal a process through descriptors {hits.value}"
    held(executor)


def test_no_clear_refs_descriptor_is_held(executor: LocalExecutor, client: ExecutorClient) -> None:
    for entry in _descriptors(client).values():
        assert "clear_refs" not in entry["target"], entry
    held(executor)


# ---------------------------------------------------------------------------------------- secrets


def _allowed(name: str) -> bool:
    return name in ALWAYS or name.startswith(ALWAYS_PREFIXES)


def test_secrets_in_the_executors_environment_are_not_in_a_tools_environment(
    start_raw: Callable[..., LocalExecutor],
) -> None:
    local = start_raw(env={**os.environ, **SECRETS})
    assert local.client is not None
    seen = local.client.call(Call(tool="read_secrets")).value
    assert not set(SECRETS) & set(seen["environ"]), seen["environ"]
    assert all(_allowed(name) for name in seen["environ"]), sorted(seen["environ"])
    held(local)


def test_secrets_in_the_executors_environment_are_not_in_proc_environ(
    start_raw: Callable[..., LocalExecutor],
) -> None:
    local = start_raw(env={**os.environ, **SECRETS})
    assert local.client is not None
    seen = local.client.call(Call(tool="read_secrets")).value
    assert seen["proc_self"] == {}, f"the worker's /proc/self/environ holds {sorted(seen['proc_self'])}"
    assert seen["proc_parent"] == {}, f"the template's /proc/<pid>/environ holds {sorted(seen['proc_parent'])}"


def test_secrets_in_the_executors_environment_are_not_in_a_workers_memory(
    start_raw: Callable[..., LocalExecutor],
) -> None:
    local = start_raw(env={**os.environ, **SECRETS})
    assert local.client is not None
    halves = [[v[: len(v) // 2], v[len(v) // 2 :]] for v in SECRETS.values()]  # never whole in the request
    found = local.client.call(Call(tool="secrets_in_memory", args=[halves]))
    assert found.ok, found.error
    assert found.value["posix_environ"] == [], "posix.environ (the interpreter's copy) still holds them"
    assert found.value["memory"] == [], f"the worker's memory holds {len(found.value['memory'])} of the secrets"


def test_pass_env_hands_on_exactly_the_variables_named(start_raw: Callable[..., LocalExecutor]) -> None:
    local = start_raw(env={**os.environ, **SECRETS, "CIAYN_ATTACK_ONE": "1", "CIAYN_ATTACK_TWO": "2"},
                      pass_env=["GITHUB_TOKEN", "CIAYN_ATTACK_*"])
    assert local.client is not None
    environ = local.client.call(Call(tool="read_secrets")).value["environ"]
    assert environ["GITHUB_TOKEN"] == SECRETS["GITHUB_TOKEN"]
    assert (environ["CIAYN_ATTACK_ONE"], environ["CIAYN_ATTACK_TWO"]) == ("1", "2")
    assert "OPENAI_API_KEY" not in environ and "AWS_SECRET_ACCESS_KEY" not in environ
    held(local)


def test_a_controllers_secrets_never_reach_a_tool_through_local_executor(
    make_client: Callable[..., ExecutorClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT)
    seen = client.call(Call(tool="read_secrets")).value
    assert not set(SECRETS) & set(seen["environ"])
    assert seen["proc_self"] == {} and seen["proc_parent"] == {}, "filtered before exec: not even in /proc"
    held(client.local)  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------- the template


def kill_template(local: LocalExecutor) -> int:
    """SIGKILL the executor's template from outside (as the kernel's OOM killer or an operator
    might: a tool cannot, its template being the init of its PID namespace) and return its pid once
    a new one runs."""
    assert local.proc is not None
    old = template_of(local.proc.pid)
    assert old, "the executor has no template"
    os.kill(old, signal.SIGKILL)
    wait_until("a new template", lambda: template_of(local.proc.pid) not in (0, old),  # type: ignore[union-attr]
               timeout=TEMPLATE_ANSWER_TIMEOUT + NEW_TEMPLATE)
    return old


def test_a_tool_cannot_kill_stop_or_signal_the_template(executor: LocalExecutor, client: ExecutorClient) -> None:
    """The template is PID 1 of the workers' PID namespace: the kernel spares it every signal sent
    from inside that it has no handler for, SIGKILL and SIGSTOP included. Tools try both, and
    ``kill -1`` (every process they may signal: only their namespace's)."""
    require_layer(pid_namespaces(), "workers share the executor's PID namespace here (it takes root)")
    assert executor.proc is not None
    template = template_of(executor.proc.pid)
    assert nspid(template)[1:] == [1], "the premise: the template is PID 1 of its namespace"
    for tool in ("kill_template", "stop_template", "kill_everything"):
        r = client.call(Call(tool=tool))
        assert r.ok or (r.error is not None and r.error.kind == "crashed"), r  # kill -1 ends the tool itself too
        assert template_of(executor.proc.pid) == template, f"{tool}: the template was replaced"
        assert psutil.Process(template).status() != psutil.STATUS_STOPPED, f"{tool}: the template stopped"
        after, took = timed(client, "echo", value=tool)
        assert after.ok and after.value == tool and took < GRACE, (after, took)
    held(executor)


CAP_SYS_ADMIN = 21


def _drop_cap_sys_admin() -> None:
    """preexec_fn: drop CAP_SYS_ADMIN from the bounding set, so the executor (even as root) cannot
    make a PID namespace the root way and must use a user namespace, as any other user does."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN)")


def test_without_the_right_to_make_namespaces_the_template_gets_one_in_a_user_namespace(
    start_raw: Callable[..., LocalExecutor],
) -> None:
    """As a user without CAP_SYS_ADMIN (any user but root), the forked child makes a user namespace
    of its own uid and a PID namespace in it, and forks the template there; it stays between them as
    a relay. The tools' view is the same as root's: PID 1 is their template, the supervisor cannot be
    reached, and they hold no capability (in the user namespace the template held them all)."""
    if os.geteuid() != 0:
        pytest.skip("dropping CAP_SYS_ADMIN from the bounding set takes root (as another user this is every test)")
    local = start_raw(preexec_fn=_drop_cap_sys_admin)
    assert local.client is not None and local.proc is not None
    client = local.client
    me = client.call(Call(tool="whoami"))
    assert me.ok and me.value["ppid"] == 1, me
    assert client.call(Call(tool="capabilities")).value == 0, "a worker holds capabilities in its user namespace"
    tried = client.call(Call(tool="kill_supervisor", kwargs={"pid": local.proc.pid}))
    assert tried.ok and "sent" not in tried.value.values(), tried
    for tool in ("kill_template", "stop_template"):
        assert client.call(Call(tool=tool)).ok
        after, took = timed(client, "echo", value=tool)
        assert after.ok and after.value == tool and took < GRACE, (after, took)
    [relay] = psutil.Process(local.proc.pid).children()
    [template] = relay.children()
    assert nspid(relay.pid)[1:] == [] and nspid(template.pid)[1:] == [1]
    assert "PID namespace" not in local.log_path.read_text(), "it warned that workers share its namespace"
    wire = Wire(local.endpoint)
    try:
        wire.ping(within=1.0)
    finally:
        wire.close()


def test_killing_the_template_costs_one_call_and_the_executor_recovers(
    executor: LocalExecutor, client: ExecutorClient, tmp_path: Path
) -> None:
    assert executor.proc is not None
    assert_tree_is_supervisor_template_and(executor, None)  # no worker exit (and sweep) races the attack
    pid_file = tmp_path / "clone.pid"
    call = client.submit(Call(tool="kill_template", kwargs={"pid_file": str(pid_file), "kill": False, "hold": 30}))
    wait_until("the tool to start a child of the template", lambda: pid_file.exists() and pid_file.read_text(),
               timeout=TIMEOUT)
    orphan = host_pid(executor.proc.pid, int(pid_file.read_text().split(":")[0]))  # the template's CLONE_PARENT child
    assert orphan, "the premise: the tool left a child of the template"
    old = kill_template(executor)
    r = call.result(timeout=TIMEOUT + GRACE)
    assert r.error is not None and r.error.kind == "crashed" and r.worker is not None and r.worker.restarted, r
    # The next call may be lost to the race below (test_the_call_after_a_template_kill_succeeds); the
    # executor must not be: it answers, and calls succeed again at once.
    wait_until("a call to succeed after the template was killed",
               lambda: client.call(Call(tool="echo", args=["after"])).value == "after", timeout=GRACE)
    assert executor.proc.poll() is None
    assert not _alive(old)
    wait_until("the dead template's CLONE_PARENT child to be killed", lambda: not _alive(orphan), timeout=GRACE)
    held(executor)


def test_the_call_after_a_template_kill_succeeds(executor: LocalExecutor, client: ExecutorClient) -> None:
    """The template is killed right after a call answered: the next call may reach a worker forked
    ahead, which dies with the template. It must not be lost (such a worker does not start a call
    while its template is dying, and a worker that dies before starting one sends it back)."""
    assert executor.proc is not None
    lost = []
    rounds = 12  # the race was lost about 1 round in 3: twelve rounds miss it about 1 run in 70
    for n in range(rounds):
        assert client.call(Call(tool="echo", args=[n])).ok
        os.kill(template_of(executor.proc.pid), signal.SIGKILL)
        after = client.call(Call(tool="echo", args=[n]))
        if not after.ok:
            lost.append(after.error)
        wait_until("a template", lambda: template_of(executor.proc.pid) != 0, timeout=GRACE)  # type: ignore[union-attr]
    assert not lost, f"{len(lost)} of {rounds} innocent calls sent right after the template died failed: {lost[0]}"


def template_identity(value: dict[str, Any]) -> tuple[str, int]:
    """Which template a ``whoami`` call's worker was forked by: its PID namespace (one per template
    where the machine allows) and its parent's pid (where it does not)."""
    return value["pidns"], value["ppid"]


def test_a_replaced_template_holds_nothing_of_the_supervisors_memory(
    make_client: Callable[..., ExecutorClient],
) -> None:
    """Another client's calls pass through the supervisor, whose freed memory still holds them. The
    template dies; had the replacement been forked from the supervisor, as before, the next worker
    would find every one of them in its own address space (5 of 5 here). It is a fresh
    interpreter: none is there."""
    victim = make_client(tools=[ATTACKS], timeout=TIMEOUT)
    halves = [[f"VICTIM{uuid.uuid4().hex[:8]}", f"{uuid.uuid4().hex}END"] for _ in range(5)]
    for a, b in halves:
        assert victim.call(Call(tool="echo", args=[a + b])).value == a + b
    before = template_identity(victim.call(Call(tool="whoami")).value)
    kill_template(victim.local)  # type: ignore[attr-defined]
    found = victim.call(Call(tool="secrets_in_memory", kwargs={"halves": halves}))
    assert found.ok, found.error
    assert found.value["memory"] == [], f"a worker of the new template holds another client's calls: {found.value}"
    assert template_identity(victim.call(Call(tool="whoami")).value) != before


SHADOW_MSGPACK = """import os, sys, importlib
with open({marker!r}, "w") as f:
    f.write(str(os.getpid()))
del sys.modules["msgpack"]
sys.path[:] = [p for p in sys.path if p not in ("", {workspace!r})]
globals().update(importlib.import_module("msgpack").__dict__)
"""


def test_a_module_left_in_the_workspace_never_runs_in_a_replacement_template(
    make_client: Callable[..., ExecutorClient], tmp_path: Path,
) -> None:
    """The executor works in its workspace, which tools may write. A replacement template is a new
    interpreter started there: with its working directory on its path (as ``python -m`` puts it), a
    file named like a module it imports (msgpack.py, left by an earlier call) ran in the template,
    outside any sandbox. It starts with ``-P`` and the first template's path."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    marker = tmp_path / "shadow-ran"
    (workspace / "msgpack.py").write_text(SHADOW_MSGPACK.format(marker=str(marker), workspace=str(workspace)))
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT, workspace=str(workspace))
    before = template_identity(client.call(Call(tool="whoami")).value)
    kill_template(client.local)  # type: ignore[attr-defined]
    after = client.call(Call(tool="whoami"))
    assert after.ok and template_identity(after.value) != before, after
    assert not marker.exists(), f"msgpack.py from the workspace ran in process {marker.read_text()}"


@pytest.mark.parametrize("tool", ["", "stop_next_workers"], ids=["template", "template-and-workers"])
def test_a_stopped_template_is_replaced_and_calls_are_answered_within_a_bound(
    executor: LocalExecutor, client: ExecutorClient, tool: str
) -> None:
    """The template is stopped (SIGSTOP from outside: a tool cannot stop its namespace's init), so
    a worker forked ahead may still take the next call; with ``stop_next_workers`` a tool stops
    those workers too, and the next call has nowhere to go until the template is replaced."""
    assert executor.proc is not None
    pids = []
    if tool:
        stopped = client.call(Call(tool=tool))
        assert stopped.ok, stopped
        # (what it stopped may include the last call's worker, stopped and being killed already)
        pids = [pid for pid in (host_pid(executor.proc.pid, p) for p in stopped.value) if pid]
    template = template_of(executor.proc.pid)
    os.kill(template, signal.SIGSTOP)
    pids.append(template)
    wire = Wire(executor.endpoint)
    try:
        for i in range(3):
            r, took = timed(client, "echo", timeout=TEMPLATE_ANSWER_TIMEOUT + NEW_TEMPLATE, value=i)
            assert r.ok and r.value == i, r
            assert took < TEMPLATE_ANSWER_TIMEOUT + NEW_TEMPLATE + GRACE, f"call {i} took {took:.1f} s"
            wire.ping(within=1.0)
    finally:
        wire.close()
    wait_until("the stopped processes to be killed", lambda: not any(_alive(p) for p in pids), timeout=GRACE)
    held(executor)


def test_a_tool_holding_every_worker_cannot_make_a_queued_call_wait_past_its_timeout(
    make_client: Callable[..., ExecutorClient],
) -> None:
    """The client extends a queued call's deadline while pongs report it queued; the executor must
    answer it ``unavailable`` once it has waited its own timeout, naming the queue."""
    client = make_client(tools=[ATTACKS], timeout=30, workers=1)
    hog = client.submit(Call(tool="nap", kwargs={"seconds": 20.0}))
    wire = Wire(client.local.endpoint)  # type: ignore[attr-defined]
    try:
        wait_until("the hog to hold the only worker", lambda: wire.ping().busy == 1, timeout=5)
    finally:
        wire.close()
    r, took = timed(client, "echo", timeout=1.0, value="queued")
    assert r.error is not None and r.error.kind == "unavailable" and "queue" in r.error.message, r
    assert took < 1.0 + GRACE, f"the queued call was answered after {took:.1f} s"
    assert not hog.done()


def test_a_tool_cannot_kill_the_supervisor_or_leave_processes_behind_it(
    make_client: Callable[..., ExecutorClient], tmp_path: Path
) -> None:
    """Closed (was: a tool SIGKILLed the supervisor, its parent's parent, of the same user: the
    executor was gone and a ``CLONE_PARENT`` child of the template outlived it). The workers' PID
    namespace leaves a tool no way to address the supervisor: told its pid, ``kill``, ``pidfd_open``
    and a ``/proc/PID`` descriptor all fail."""
    require_layer(pid_namespaces(), "workers share the executor's PID namespace here (it takes root)")
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT)
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    assert local.proc is not None and client.welcome is not None
    pid_file = tmp_path / "clone.pid"
    for pid in (0, local.proc.pid):  # the parent of its template, then the supervisor's pid as the host knows it
        attack = client.call(Call(tool="kill_supervisor", kwargs={"pid_file": str(pid_file), "pid": pid}))
        assert local.proc.poll() is None, f"the executor died (exit {local.proc.returncode})"
        assert attack.ok, attack.error
        assert "sent" not in attack.value.values(), f"a signal reached something: {attack.value}"
        assert client.call(Call(tool="echo", args=["after"])).value == "after"
        if pid_file.exists():  # (a hardened worker, PID 1 of its own namespace, cannot make one)
            wait_until("the CLONE_PARENT child to be killed",
                       lambda: not host_pid(local.proc.pid, int(pid_file.read_text())),  # type: ignore[union-attr]
                       timeout=GRACE)
    held(local)


# --------------------------------------------------------------------------- processes that will not die


def test_a_worker_stuck_in_uninterruptible_sleep_is_answered_on_time_and_abandoned(
    executor: LocalExecutor, client: ExecutorClient, freezer: Path
) -> None:
    r, took = timed(client, "freeze_self", timeout=1.0, group=str(freezer))
    assert r.error is not None and r.error.kind == "timeout", r
    assert took < 1.0 + KILL_GRACE + GRACE, f"answered after {took:.1f} s"
    assert r.worker is not None
    stuck = r.worker.pid
    assert psutil.Process(stuck).status() == psutil.STATUS_DISK_SLEEP, "the premise: SIGKILL cannot stop it"
    after, took = timed(client, "echo", value="next")
    assert after.ok and took < GRACE, (after, took)
    assert f"pid {stuck}" in executor.log_path.read_text() and "abandoned" in executor.log_path.read_text()
    thaw(freezer)
    wait_until("the abandoned worker to die once thawed", lambda: not _alive(stuck), timeout=5)
    held(executor)
    if CgroupSupport.detect() is not None:  # the abandoned worker's group goes once it is empty
        assert executor.client is not None and executor.client.welcome is not None
        executor_id = executor.client.welcome.executor
        wait_until("the abandoned worker's groups to be removed",
                   lambda: groups_match_live_workers(executor, executor_id, 1), timeout=5)


def test_a_child_left_in_uninterruptible_sleep_does_not_wedge_the_executor(
    make_client: Callable[..., ExecutorClient], freezer: Path
) -> None:
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT)
    _, took = timed(client, "freeze_child", timeout=1.0, group=str(freezer))
    assert took < 1.0 + KILL_GRACE + GRACE, f"the call that left the child was answered after {took:.1f} s"
    for i in range(3):  # a call's limit long enough for a template replacement, short enough to fail fast
        after, took = timed(client, "echo", timeout=TEMPLATE_ANSWER_TIMEOUT + NEW_TEMPLATE, value=i)
        assert after.ok and after.value == i, after
        assert took < TEMPLATE_ANSWER_TIMEOUT + NEW_TEMPLATE + GRACE, f"call {i} took {took:.1f} s"
    frozen = [int(pid) for pid in (freezer / "cgroup.procs").read_text().split()]
    assert frozen, "the premise: the child is still there, frozen"
    thaw(freezer)  # only now can it die; then nothing of the attack may be left
    wait_until("the child to die once thawed", lambda: not any(_alive(pid) for pid in frozen), timeout=5)
    held(client.local)  # type: ignore[attr-defined]


def test_a_template_that_cannot_be_killed_is_abandoned_and_replaced(
    make_client: Callable[..., ExecutorClient], freezer: Path
) -> None:
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT)
    frozen = client.call(Call(tool="freeze_template", kwargs={"group": str(freezer)}))
    assert frozen.ok, frozen.error
    for i in range(3):
        after, took = timed(client, "echo", timeout=TEMPLATE_ANSWER_TIMEOUT + KILL_GRACE + NEW_TEMPLATE, value=i)
        assert after.ok and after.value == i, after
        assert took < TEMPLATE_ANSWER_TIMEOUT + KILL_GRACE + NEW_TEMPLATE + GRACE, f"call {i} took {took:.1f} s"
    wire = Wire(client.local.endpoint)  # type: ignore[attr-defined]
    try:
        wire.ping(within=1.0)
    finally:
        wire.close()


def test_a_worker_does_not_start_a_call_while_its_template_is_dying(
    make_client: Callable[..., ExecutorClient], freezer: Path
) -> None:
    """The race of ``test_the_call_after_a_template_kill_succeeds`` held open: the template is frozen
    with a SIGKILL pending, dying but not dead, as in the gap between its kill and its exit. The next
    call reaches the worker forked ahead, which would die with the template (and the call be
    answered ``crashed``) once it exits: that worker must not start it, and the call must run in a
    worker of the next template. Two workers: one for the first call, one forked ahead for the next."""
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT, workers=2)
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    assert local.proc is not None
    first = client.call(Call(tool="whoami"))  # its worker exits; another is forked once the pool is quiet
    assert first.ok and first.worker is not None, first.error
    template = psutil.Process(template_of(local.proc.pid))
    wait_until("two workers to be forked ahead",
               lambda: len([c for c in template.children() if c.pid != first.worker.pid]) == 2,  # type: ignore[union-attr]
               timeout=5)
    freezer.mkdir()
    (freezer / "cgroup.procs").write_text(str(template.pid))
    (freezer / "freezer.state").write_text("FROZEN")
    template.kill()  # pending until it is thawed
    after, took = timed(client, "whoami", timeout=TEMPLATE_ANSWER_TIMEOUT + 2 * KILL_GRACE + NEW_TEMPLATE)
    assert after.ok, after.error
    assert template_identity(after.value) != template_identity(first.value), \
        "the call ran in a worker of the dying template"
    assert took < TEMPLATE_ANSWER_TIMEOUT + 2 * KILL_GRACE + NEW_TEMPLATE + GRACE, f"the call took {took:.1f} s"


def test_shutdown_with_a_worker_that_cannot_be_killed_ends_within_a_bound(
    make_client: Callable[..., ExecutorClient], freezer: Path
) -> None:
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT)
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    r = client.call(Call(tool="freeze_self", kwargs={"group": str(freezer)}), timeout=1.0)
    assert r.error is not None and r.error.kind == "timeout", r
    assert local.proc is not None
    local.proc.send_signal(signal.SIGTERM)
    try:
        local.proc.wait(timeout=KILL_GRACE + 2.0 + GRACE)
    except subprocess.TimeoutExpired:
        pytest.fail("the executor did not exit on SIGTERM while a worker could not be killed")


# ------------------------------------------------------------------------------------------ limits


NOBODY = 65534


@pytest.mark.parametrize("who", ["root-without-cap-sys-resource", "non-root-user"])
def test_hard_limits_cannot_be_lifted(start_raw: Callable[..., LocalExecutor], who: str) -> None:
    """Root with CAP_SYS_RESOURCE may raise hard limits (the README sends such operators to the
    hardened profile); without the capability, as any non-root user, the kernel refuses."""
    if who == "non-root-user":
        if os.geteuid() != 0:
            pytest.skip("starting the executor as another user needs root")
        try:
            subprocess.run([sys.executable, "-c", "import executor"], user=NOBODY, group=NOBODY, extra_groups=[],
                           check=True, capture_output=True, timeout=30)
        except (OSError, subprocess.CalledProcessError) as e:
            pytest.skip(f"uid {NOBODY} cannot run this interpreter and project ({e}); "
                        "the root-without-CAP_SYS_RESOURCE case covers the same kernel rule")
        local = start_raw(user=NOBODY)
        assert local.client is not None
        assert local.client.call(Call(tool="whoami")).ok
        assert psutil.Process(local.proc.pid).uids().real == NOBODY  # type: ignore[union-attr]
    else:
        local = start_raw(preexec_fn=_drop_cap_sys_resource)
        assert local.client is not None
    caps = local.client.call(Call(tool="capabilities")).value
    assert not caps & (1 << CAP_SYS_RESOURCE), "the premise: the executor runs without CAP_SYS_RESOURCE"
    tried = local.client.call(Call(tool="lift_limits"))
    assert tried.ok, tried.error
    for name, entry in tried.value.items():
        assert entry["raised"] is False, f"the tool lifted its hard {name} limit: {entry}"
        assert entry["hard"] != -1 and entry["now"][1] == entry["hard"], f"{name}: {entry}"
        slack = 1 if name == "CPU" else 0  # SIGXCPU at the soft limit, SIGKILL a second later
        assert entry["hard"] == entry["soft"] + slack, f"{name}: the hard limit is not the soft one: {entry}"
    held(local)


def test_a_tool_ignoring_sigxcpu_is_stopped_by_the_hard_cpu_limit(make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[ATTACKS], timeout=20, cpu_s=1)
    r, took = timed(client, "spin_ignoring_sigxcpu")
    assert r.error is not None and r.error.kind == "timeout" and "CPU" in r.error.message, r.error
    assert r.stats is not None and r.stats.cpu_s < 1 + 1 + GRACE, r.stats  # soft limit, then hard one a second later
    assert took < 20, "the CPU limit, not the wall clock, stopped it"
    assert r.worker is not None and r.worker.restarted
    held(client.local)  # type: ignore[attr-defined]


CLONE_PROFILES = {
    "fresh": {},
    "fresh-no-cgroups": {"no_cgroups": True},
    "reuse": {"reuse_workers": True},
    "reuse-no-cgroups": {"reuse_workers": True, "no_cgroups": True},
}


@pytest.mark.parametrize("options", list(CLONE_PROFILES.values()), ids=list(CLONE_PROFILES))
def test_clone_parent_children_do_not_outlive_the_call(
    make_client: Callable[..., ExecutorClient], options: dict[str, Any]
) -> None:
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT, **options)
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    assert local.proc is not None
    me = client.call(Call(tool="whoami"))
    assert me.ok and me.worker is not None
    template = me.value["ppid"]  # as the tool sees it
    # Wait for the worker of that call to be gone: the template's sweep at its exit would otherwise
    # kill the clones while the attack is still making them (which is a defense, but hides the premise).
    assert_tree_is_supervisor_template_and(local, None if not options.get("reuse_workers") else me.worker.pid)
    r = client.call(Call(tool="clone_parent_chain", kwargs={"depth": 3}))
    # The template may sweep the chain before it is complete, even before the maker reads a clone's parent
    # (a reused worker's previous call ends with a sweep, which may come late): that is the defense working.
    assert r.ok and r.value, r
    if not options.get("reuse_workers"):  # no sweep can race the attack: the premise must show
        assert any(c["ppid"] == template for c in r.value), f"the premise: children of the template, {r.value}"
    assert all(c["ppid"] in (template, 0) for c in r.value), r.value  # 0: already killed
    pids = [c["pid"] for c in r.value]  # in the tool's PID namespace
    wait_until("the CLONE_PARENT children to be killed",
               lambda: not any(host_pid(local.proc.pid, p) for p in pids), timeout=GRACE)  # type: ignore[union-attr]
    after = client.call(Call(tool="whoami"))
    assert after.ok and after.worker is not None
    held(local, after.worker.pid if options.get("reuse_workers") else None)


def _live_rabbits() -> list[int]:
    """Live processes named ``ciayn-rabbit`` (the ``rabbits`` attack's)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and Path(f"/proc/{name}/comm").read_text().strip() == "ciayn-rabbit":
                found.append(int(name))
        except OSError:
            continue
    return [pid for pid in found if _alive(pid)]


@pytest.mark.parametrize("options", [{}, {"no_cgroups": True}], ids=["cgroups", "no-cgroups"])
def test_processes_that_keep_changing_pid_do_not_outlive_the_call(
    make_client: Callable[..., ExecutorClient], options: dict[str, Any]
) -> None:
    """A killer that lists children, then kills them, chases processes that fork and exit over and
    over; it must win within its bound (with cgroups the group kill does not chase at all)."""
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT, **options)
    r = client.call(Call(tool="rabbits", kwargs={"count": 4, "lifetime": 2 * TIMEOUT}))
    assert r.ok, r.error
    # The worker chases them before it replies, the template after the worker's exit: each for a bounded time.
    wait_until("every rabbit to be killed", lambda: not _live_rabbits(), timeout=2 * GRACE)
    assert client.call(Call(tool="echo", args=[1])).ok
    held(client.local)  # type: ignore[attr-defined]


# ------------------------------------------------------------------- oversized errors, signals, floods


def _encoded_kb(r: Result) -> float:
    return sum(len(frame) for frame in encode(r)) / 1024


def test_a_50_mb_exception_type_name_arrives_cut_with_a_note(executor: LocalExecutor, client: ExecutorClient) -> None:
    r = client.call(Call(tool="huge_exception_type", kwargs={"mb": 50}))
    assert r.error is not None and r.error.kind == "tool_error", r.error
    assert r.error.type is not None and r.error.type.startswith("EEEE") and "cut" in r.error.type
    assert len(r.error.type) < 1000 and r.error.message == "short message"
    assert r.error.traceback is not None and len(r.error.traceback) < 10_000
    assert _encoded_kb(r) < 4096
    held(executor)


def test_a_50_mb_exception_message_arrives_cut_with_a_note(executor: LocalExecutor, client: ExecutorClient) -> None:
    r = client.call(Call(tool="huge_exception_message", kwargs={"mb": 50}))
    assert r.error is not None and r.error.kind == "tool_error" and r.error.type == "Loud", r.error
    assert r.error.message.startswith("mmmm") and "cut" in r.error.message and len(r.error.message) < 10_000
    assert _encoded_kb(r) < 4096
    held(executor)


def test_40_mb_of_signals_arrive_cut_with_a_note(executor: LocalExecutor, client: ExecutorClient) -> None:
    r = client.call(Call(tool="huge_signals", kwargs={"mb": 40, "count": 40}))
    assert r.ok and len(r.signals) == 40, r
    assert all("cut" in s.message and len(s.message) < 10_000 for s in r.signals)
    assert r.completed is not None, "the completion signal (the last one) arrives"
    assert _encoded_kb(r) < 4096
    held(executor)


def test_40_mb_in_40000_signals_arrive_cut_with_a_note(executor: LocalExecutor, client: ExecutorClient) -> None:
    r = client.call(Call(tool="huge_signals", kwargs={"mb": 40, "count": 40_000}))
    assert r.ok and r.signals, r
    assert _encoded_kb(r) < 4096
    notes = [s.message for s in r.signals if "signal" in s.message.lower()
             and any(word in s.message.lower() for word in ("cut", "dropped", "left out", "more"))]
    assert notes, f"{len(r.signals)} of 40000 signals arrived and none says that the rest were cut"


@pytest.mark.parametrize("announce", ["small", "huge", "raw"])
def test_120_mb_on_the_workers_channel_costs_only_the_worker(
    executor: LocalExecutor, client: ExecutorClient, announce: str
) -> None:
    """``small``: frames that each announce 1 MB (under the cap) of garbage; ``huge``: one frame that
    announces 120 MB; ``raw``: headerless bytes (a header of 0xffffffff)."""
    assert executor.proc is not None
    supervisor = psutil.Process(executor.proc.pid)
    before = supervisor.memory_info().rss
    r = client.call(Call(tool="flood_channel", kwargs={"mb": 120, "announce": announce}))
    assert r.error is not None, r
    if announce == "small":  # a frame under the cap is read, then found not to be a reply
        assert r.error.kind == "crashed" and "malformed" in r.error.message, r.error
    else:
        assert r.error.kind in ("output_limit", "protocol"), r.error
    assert r.worker is not None and r.worker.restarted
    grew = (supervisor.memory_info().rss - before) / 2**20
    assert grew < 16, f"the supervisor grew by {grew:.0f} MB"
    held(executor)


@pytest.mark.parametrize("stall", [True, False], ids=["header-then-nothing", "120-mb"])
def test_writing_on_the_templates_channel_costs_only_the_template(
    make_client: Callable[..., ExecutorClient], stall: bool
) -> None:
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT)
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    assert local.proc is not None
    template = template_of(local.proc.pid)
    try:
        client.call(Call(tool="write_on_template_channel", kwargs={"mb": 120, "stall": stall}))
        wire = Wire(local.endpoint)
        try:
            wire.ping(within=1.0)
        finally:
            wire.close()
        after = client.call(Call(tool="echo", args=["after"]), timeout=TEMPLATE_ANSWER_TIMEOUT + NEW_TEMPLATE)
        assert after.ok and after.value == "after", after
        peak = supervisor_peak_mb(local)
        assert peak < SUPERVISOR_PEAK_MB, f"the supervisor's RSS peaked at {peak:.0f} MB"
        held(local)
    finally:
        if _alive(template):  # a wedged supervisor waits on this template's channel: closing it frees it
            os.kill(template, signal.SIGKILL)


# ------------------------------------------------------------------------ each defense layer on its own


def test_tools_get_stdin_at_eof_when_the_executor_has_an_open_stdin_pipe(
    start_raw: Callable[..., LocalExecutor],
) -> None:
    local = start_raw(stdin=subprocess.PIPE)  # kept open and never written: a read would wait forever
    assert local.client is not None and local.proc is not None and local.proc.stdin is not None
    r, took = timed(local.client, "read_stdin", timeout=3.0)
    assert r.ok and r.value == {"data": "", "chr": True, "target": "/dev/null"}, r
    assert took < GRACE
    held(local)


def test_memory_limits_hold_without_cgroups(make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[ATTACKS], timeout=TIMEOUT, memory_mb=200, no_cgroups=True)
    groups = client.call(Call(tool="cgroups")).value
    assert "ciayn-" not in groups, f"the premise: no control group of ours holds the worker\n{groups}"
    r = client.call(Call(tool="allocate", kwargs={"mb": 400}))
    assert r.error is not None and r.error.kind == "memory", r
    assert r.worker is not None and r.worker.restarted
    assert client.call(Call(tool="echo", args=[1])).value == 1
    held(client.local)  # type: ignore[attr-defined]


def _group_names(pid: int) -> set[str]:
    """The names of the groups (ours: ``ciayn-...``) that hold ``pid``, in every hierarchy."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return set()
    return {line.rsplit("/", 1)[-1] for line in lines if "/ciayn-" in line}


def groups_match_live_workers(local: LocalExecutor, executor_id: str, workers: int) -> bool:
    """Whether the executor has ``workers`` live workers, each in exactly one group (per hierarchy),
    and no other group of this executor exists (none left by dead workers)."""
    support = CgroupSupport.detect()
    assert support is not None and local.proc is not None
    parents = {p for p in (support.memory_parent, support.pids_parent, support.kill_parent) if p is not None}
    supervisor = local.proc.pid
    live = [p.pid for p in psutil.Process(supervisor).children(recursive=True)
            if p.ppid() != supervisor and _alive(p.pid)]
    held_by_workers = [_group_names(pid) for pid in live]
    existing = {g.name for parent in parents for g in parent.glob(f"ciayn-{executor_id}-*")}
    return (len(live) == workers and all(len(names) == 1 for names in held_by_workers)
            and existing == set().union(*held_by_workers))


def test_exactly_one_group_per_live_worker_after_crashes(make_client: Callable[..., ExecutorClient]) -> None:
    require_layer(CgroupSupport.detect() is not None, "needs root and mounted cgroup hierarchies (memory/pids)")
    client = make_client(tools=[ATTACKS], workers=2, timeout=TIMEOUT, memory_mb=200)
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    assert client.welcome is not None
    crashes: list[tuple[str, dict[str, Any], str]] = [
        ("die", {"signum": 9}, "crashed"), ("die", {"signum": 11}, "crashed"),
        ("allocate", {"mb": 400}, "memory"), ("nap", {"seconds": 30.0}, "timeout")]
    for tool_name, kwargs, kind in crashes * 2:
        r = client.call(Call(tool=tool_name, kwargs=kwargs, timeout=0.5 if kind == "timeout" else None))
        assert r.error is not None and r.error.kind == kind, r
    executor_id = client.welcome.executor
    wait_until("exactly one group per live worker, and no other group of this executor",
               lambda: groups_match_live_workers(local, executor_id, 2), timeout=5)
    wire = Wire(local.endpoint)  # two workers: held()'s one-worker tree check does not apply
    try:
        wire.ping(within=1.0)
    finally:
        wire.close()
    assert supervisor_peak_mb(local) < SUPERVISOR_PEAK_MB
