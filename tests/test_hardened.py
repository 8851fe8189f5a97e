"""The hardened profile, attacked for real: every escape of ``executor.sandbox.selfcheck`` as its own test
against a real ``serve --profile hardened`` (real namespaces, cgroups, seccomp, Landlock), a
scripted model driving ``run_shell`` through the same escapes, the start-up gate, and the host left
as it was found. They need root and the kernel features; elsewhere they skip, naming what is
missing (CI runs as root, so they run there)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import psutil
import pytest

from controller import LocalExecutor
from controller.ciayn import CiaynAgent
from controller.models import ScriptedModel
from executor.sandbox import mounts, seccomp, selfcheck, start
from executor.sandbox.config import HardenedConfig
from executor.sandbox.identity import NOBODY
from executor.sandbox.layers import LAYER_NAMES, LAYERS, probe_all
from executor.sandbox.profile import Sandbox
from protocol import Call, Result

TOOLS = str(Path(__file__).parent / "tools" / "hostile_hardened.py")
SHELL = ["executor.toolkits.builtin", "executor.toolkits.shell"]  # the README's CI recipe
MISSING = probe_all()
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"this machine lacks hardened layers: {MISSING}")


@pytest.fixture(scope="module")
def target() -> Iterator[selfcheck.Target]:
    with selfcheck.Target() as t:
        yield t


@pytest.mark.parametrize("attempt", selfcheck.attempts(), ids=[a.tool + ":" + a.name for a in selfcheck.attempts()])
def test_escape_is_denied(target: selfcheck.Target, attempt: selfcheck.Attempt) -> None:
    row = target.attempt(attempt)
    assert row.ok, f"{attempt.layer}: {attempt.name}: expected {attempt.expected}, observed {row.observed}"


@pytest.mark.parametrize("rw", [False, True], ids=["read-only", "workspace-rw"])
def test_a_replaced_template_denies_every_escape_as_the_first_did(rw: bool) -> None:
    """A template that died is replaced by a fresh interpreter (never a fork of the supervisor's
    memory), which rebuilds the sandbox from what the supervisor sends it: its workers must deny
    every attempt the first template's workers deny, and leave nothing on the host."""
    with selfcheck.Target(workers=2, extra=selfcheck.RW_EXTRA if rw else (), replace_template=True) as t:
        rows = [t.attempt(a) for a in selfcheck.attempts(workspace_rw=rw)]
    failed = [f"{r.layer}: {r.attempt}: {r.observed}" for r in rows + t.host_rows if not r.ok]
    assert not failed, "\n".join(failed)


def test_nothing_is_left_on_the_host_after_the_executor_exits() -> None:
    """Processes, files in /dev/shm, control groups and mounts of a hardened executor whose calls
    forked, daemonized, filled /dev/shm and hit the memory limit: all gone once it stopped."""
    leavers = [a for a in selfcheck.ATTEMPTS
               if a.tool in ("spawn_daemon", "write_dev_shm", "fork_bomb", "shared_memory_bomb")]
    with selfcheck.Target() as t:
        for attempt in leavers:
            t.attempt(attempt)
    assert [r.attempt for r in t.host_rows] == [f"host after exit: no {w} left"
                                                 for w in ("processes", "mounts", "groups", "shm")]
    assert all(r.ok for r in t.host_rows), [(r.attempt, r.observed) for r in t.host_rows if not r.ok]


def test_selfcheck_command_exits_zero_with_json_rows() -> None:
    proc = subprocess.run([sys.executable, "-m", "executor.cli", "selfcheck", "--json"], capture_output=True,
                          text=True, timeout=180, check=False)
    report = json.loads(proc.stdout)
    failed = [r for r in report["rows"] if not r["ok"]]
    assert proc.returncode == 0 and report["ok"], failed
    assert len(report["rows"]) == len(selfcheck.attempts()) + 4
    assert {"layer", "attempt", "expected", "observed", "ok"} <= set(report["rows"][0])


@pytest.mark.parametrize("attempt", selfcheck.attempts(workspace_rw=True),
                         ids=[a.tool + ":" + a.name for a in selfcheck.attempts(workspace_rw=True)])
def test_with_workspace_rw_only_the_workspace_is_written_as_its_owner(rw_target: selfcheck.Target,
                                                                     attempt: selfcheck.Attempt) -> None:
    """With --workspace-rw the tools act as the workspace's owner in it (an idmapped mount): what
    they write there belongs to that owner (root here), not to nobody; they leave no set-ID file,
    FIFO or socket there; everything else holds as with a read-only workspace."""
    row = rw_target.attempt(attempt)
    assert row.ok, f"{attempt.layer}: {attempt.name}: expected {attempt.expected}, observed {row.observed}"


def test_a_workspace_under_tmp_is_shown_on_top_of_the_private_tmp() -> None:
    """A workspace under the host's /tmp is bound into each worker after its own /tmp is mounted
    (read-only, or with --workspace-rw through the idmapped mount the template staged)."""
    for extra, written in (((), False), (selfcheck.RW_EXTRA, True)):
        with selfcheck.Target(workers=2, extra=extra, parent="/tmp") as t:
            row = t.attempt(next(a for a in selfcheck.ATTEMPTS if a.tool == "write_file" and a.mode != "any"
                                 and a.mode == ("rw" if written else "ro")))
            assert row.ok, (extra, row.observed)
            assert t.attempt(next(a for a in selfcheck.ATTEMPTS if a.name.startswith("write outside"))).ok
        assert all(r.ok for r in t.host_rows), t.host_rows


@pytest.fixture(scope="module")
def rw_target() -> Iterator[selfcheck.Target]:
    with selfcheck.Target(workers=2, extra=selfcheck.RW_EXTRA) as t:
        yield t


# --- the profile from a client's side: run_shell under a scripted model -------------------------


class Recording:
    """An executor client that keeps every result the agent got."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.results: list[Result] = []

    def tools(self) -> Any:
        return self.client.tools()

    def submit(self, call: Call, timeout: float | None = None) -> Future[Result]:
        future: Future[Result] = self.client.submit(call, timeout)
        future.add_done_callback(lambda f: self.results.append(f.result()))
        return future

    def call(self, call: Call, timeout: float | None = None) -> Result:
        return self.submit(call, timeout).result()

    def cancel(self, call_id: str) -> None:
        self.client.cancel(call_id)


@pytest.fixture(scope="module")
def shell_executor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, LocalExecutor]]:
    """``serve --profile hardened`` (start-up selfcheck included) with the shell toolkit."""
    workspace = tmp_path_factory.mktemp("ws")
    workspace.chmod(0o755)  # tools run as nobody
    (workspace / "notes.txt").write_text("readable\n")
    local = LocalExecutor(tools=[*SHELL, TOOLS], workspace=workspace, profile="hardened", workers=2, timeout=20,
                          memory_mb=256, max_processes=32)
    os.environ["CIAYN_TEST_API_KEY"] = "sk-test-hardened-secret"
    try:
        client = local.start()
    finally:
        del os.environ["CIAYN_TEST_API_KEY"]
    yield client, local
    local.stop()


def test_model_driven_run_shell_cannot_get_out(shell_executor: tuple[Any, LocalExecutor]) -> None:
    client, local = shell_executor
    assert local.proc is not None
    supervisor = local.proc.pid
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    mark = f"{uuid.uuid4().int % 10**6:06d}"
    escapes = {
        "shadow": "cat /etc/shadow",
        "ssh": "ls /root/.ssh",
        "etc": "echo x > /etc/ciayn-escaped",
        "workspace": "echo x > notes.txt",
        "tcp": f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\"",
        "signal": f"kill -0 {supervisor}",
        "environ": f"cat /proc/{supervisor}/environ",
        "secret": "env | grep -q sk-test-hardened-secret",
        "sysctl": "cat /proc/sys/vm/overcommit_memory > /proc/sys/vm/overcommit_memory",
        "remount": "mount -o remount,rw /",
        "cgroup": "echo $$ > /sys/fs/cgroup/memory/cgroup.procs",
        "shm": "dd if=/dev/zero of=/dev/shm/fill bs=1M count=500 2>/dev/null",
        "socket": f"ls {local.dir}",
    }
    commands = [f"{cmd} && echo ESCAPED-{key}" for key, cmd in escapes.items()]
    commands += ["echo ALIVE-$(id -u)-$(ls -d /proc/[0-9]* | wc -l)", f"(setsid sleep 300.{mark} &) ; echo started"]
    script = [f"run_shell(command={c!r})" for c in commands] + ['complete_task(summary="tried")']
    recording = Recording(client)
    events = list(CiaynAgent(ScriptedModel(script), recording, max_steps=len(script) + 2).stream("get out"))
    assert events
    values = [r.value for r in recording.results if r.ok and isinstance(r.value, dict)]
    assert len(values) == len(commands), [r.error for r in recording.results if not r.ok]
    outputs = "\n".join(str(v.get("stdout", "")) + str(v.get("stderr", "")) for v in values)
    assert "ESCAPED" not in outputs, outputs
    seen = int(outputs.split("ALIVE-65534-")[1].split()[0])  # the shell ran as nobody...
    assert seen < 8, outputs  # ...seeing only the worker, the shell and its own commands
    deadline = time.monotonic() + 5
    while any(mark in " ".join(p.info["cmdline"] or ()) for p in psutil.process_iter(["cmdline"])):
        assert time.monotonic() < deadline, "a daemon started through run_shell outlived its call"
        time.sleep(0.05)
    listener.settimeout(0.1)
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


def test_worker_view_is_scratch_with_the_workspace_named(shell_executor: tuple[Any, LocalExecutor]) -> None:
    client, local = shell_executor
    result = client.call_text("where_am_i()")
    assert result.ok, result.error
    assert result.value["pid"] == 1 and result.value["uid"] == NOBODY
    assert result.value["cwd"] == "/tmp" and result.value["home"] == "/tmp" and result.value["tmpdir"] == "/tmp"
    assert result.value["workspace"] == str(local.workspace)
    assert client.call_text("scratch_roundtrip(megabytes=8)").value == 8 << 20
    too_big = client.call_text("scratch_roundtrip(megabytes=200)")  # past the /tmp cap
    assert not too_big.ok and "No space left" in (too_big.error.message if too_big.error else "")


def test_each_hardened_call_gets_a_fresh_worker(shell_executor: tuple[Any, LocalExecutor]) -> None:
    client, _ = shell_executor
    pids = {client.call_text("where_am_i()").worker.pid for _ in range(3)}
    assert len(pids) == 3


# --- the start-up gate -----------------------------------------------------------------------------


def _serve_args(**overrides: Any) -> argparse.Namespace:
    args = dict(reuse_workers=False, no_cgroups=False, bind="ipc:///tmp/x/executor.sock", connect=None,
                curve_secret=None, workspace=None, workspace_rw=False, memory_mb=256, allow_degraded=False,
                skip_selfcheck=True, pass_env=[])
    args.update(overrides)
    return argparse.Namespace(**args)


def test_hardened_refuses_naming_a_layer_the_machine_lacks(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("executor.sandbox.layers.probe_all", lambda: {"landlock": "the kernel has no Landlock"})
    args = _serve_args()
    assert start.start_hardened(args) == 1
    assert "landlock (the kernel has no Landlock)" in capsys.readouterr().err
    assert getattr(args, "confinement", None) is None


def test_allow_degraded_serves_without_the_missing_layer_loudly(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("executor.sandbox.layers.probe_all", lambda: {"landlock": "the kernel has no Landlock"})
    monkeypatch.setattr("atexit.register", lambda fn: fn)
    args = _serve_args(allow_degraded=True)
    assert start.start_hardened(args) == 0
    assert "DEGRADED" in capsys.readouterr().err
    sandbox = args.confinement
    assert sandbox is not None and "landlock" not in sandbox.names and "seccomp" in sandbox.names


@pytest.mark.parametrize("flag", [{"reuse_workers": True}, {"no_cgroups": True}])
def test_hardened_refuses_options_that_would_weaken_it(flag: dict[str, bool]) -> None:
    assert start.start_hardened(_serve_args(**flag)) == 2


def test_hardened_refuses_a_workspace_its_uid_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert start.start_hardened(_serve_args(workspace=str(private))) == 2
    assert "cannot read the workspace" in capsys.readouterr().err
    private.chmod(0o555)
    assert start.start_hardened(_serve_args(workspace=str(private), workspace_rw=True)) == 2
    assert "chmod u+rwx" in capsys.readouterr().err


def test_seccomp_program_is_well_formed() -> None:
    program = seccomp.seccomp_program()
    assert len(program) % 8 == 0 and len(program) // 8 < 4096
    assert len(seccomp.DENIED_SYSCALLS) == len(set(seccomp.DENIED_SYSCALLS))


def test_result_lists_the_layers_and_a_cpu_hog_is_a_timeout(make_client: Any, tmp_path: Path) -> None:
    """Under hardened, ``worker.layers`` names every layer; a CPU hog (in PID 1 of its namespace, where
    the kernel does not deliver SIGXCPU) is still answered ``timeout``, as under the default profile."""
    tmp_path.chmod(0o755)
    faulty = str(Path(__file__).parent / "tools" / "faulty.py")
    for profile, layers in (("default", []), ("hardened", list(LAYER_NAMES))):
        client = make_client(tools=[faulty], workspace=tmp_path, profile=profile, cpu_s=1, timeout=20)
        noop = client.call_text("noop()")
        assert noop.ok and noop.worker.layers == layers
        hog = client.call_text("busy_loop()")
        assert hog.error is not None and hog.error.kind == "timeout", (profile, hog.error)


# --- the integrity issue's suites, rerun under the hardened profile ----------------------------------
# (test_executor_faults.py's fault table and test_attacks.py's takeovers, which are holes of the
# default profile: pinned there as strict xfails, closed here)

# The attack suite's tests themselves are rerun here (``ATTACK_SUITE``): the one test module imported.
import test_attacks as attack_suite  # noqa: E402 (tests/ is on sys.path: pytest's rootdir-relative import)

from tests.support.attacks import ATTACKS, start_raw  # noqa: E402
from tests.support.attacks import start as start_attacked  # noqa: E402
from tests.support.faults import FAULTS, ROUNDS  # noqa: E402
from tests.support.faults import start as _start  # noqa: E402
from tests.support.faults import survives as _survives  # noqa: E402
from tests.support.wire import Wire  # noqa: E402

__all__ = ["start_raw"]  # a fixture, used by name


@pytest.fixture(scope="module")
def hardened_faults() -> Iterator[LocalExecutor]:
    local = _start(profile="hardened")
    yield local
    local.stop()


@pytest.mark.parametrize(("round_", "fault"), [(r, f) for r in range(ROUNDS) for f in FAULTS],
                         ids=[f"round{r}-{f.tool}" for r in range(ROUNDS) for f in FAULTS])
def test_hardened_executor_survives_misbehaving_tool(round_: int, fault: Any, hardened_faults: LocalExecutor) -> None:
    """The fault table under --profile hardened: same error kinds, timings, replacements and process
    tree. The pids a tool reports are its namespace's, so leftovers are judged by the host's tree.
    Forking 200 children (each into the worker's pids group and PID namespace) gets 6 s instead of
    the table's 2: on this shared 2-core machine it takes 2-4 s in either profile."""
    assert hardened_faults.client is not None
    wire = Wire(hardened_faults.endpoint)
    if fault.tool == "fork_children":
        fault = dataclasses.replace(fault, timeout=6.0)
    try:
        _survives(dataclasses.replace(fault, leftovers=None), hardened_faults, hardened_faults.client, wire)
    finally:
        wire.close()


@pytest.fixture(scope="module")
def hardened_attacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalExecutor]:
    workspace = tmp_path_factory.mktemp("attacks")
    workspace.chmod(0o755)
    local = LocalExecutor(tools=[ATTACKS], timeout=2.0, workers=2, profile="hardened", workspace=workspace)
    local.start()
    yield local
    local.stop()


def test_a_tool_cannot_take_over_the_workers_forked_for_later_calls(hardened_attacks: LocalExecutor) -> None:
    client = hardened_attacks.client
    assert client is not None
    attack = client.call(Call(tool="hijack_next_worker", kwargs={"log": "/tmp/seen.log", "seconds": 3.0}))
    assert attack.ok or attack.error is not None
    for i in range(3):
        r = client.call(Call(tool="echo", args=[f"innocent {i}"]))
        assert r.ok and r.value == f"innocent {i}", f"a later call was answered by the attacker: {r}"
    _answers_ping(hardened_attacks)


def _answers_ping(local: LocalExecutor) -> None:
    assert local.proc is not None and local.proc.poll() is None, local.log_tail()
    wire = Wire(local.endpoint)
    try:
        wire.ping(within=1.0)
    finally:
        wire.close()


def test_stopping_the_workers_forked_for_later_calls_is_impossible(hardened_attacks: LocalExecutor) -> None:
    client = hardened_attacks.client
    assert client is not None
    stopped = client.call(Call(tool="stop_next_workers"))
    # In its PID namespace it has no parent to look under (getppid() is 0), let alone siblings.
    assert stopped.error is not None and stopped.error.type == "FileNotFoundError", stopped
    for i in range(2):
        r = client.call(Call(tool="echo", args=[i]))
        assert r.ok and r.value == i, f"an innocent call paid for the attack: {r.error}"
    _answers_ping(hardened_attacks)


def test_a_fork_that_failed_after_the_pid_namespace_was_prepared_does_not_wedge_the_template(tmp_path: Path) -> None:
    """``before_fork`` twice with no fork between (as when ``os.fork`` raised EAGAIN): the next
    worker is still PID 1 of a namespace of its own. Run in a child: it plays the template."""
    tmp_path.chmod(0o755)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sandbox = Sandbox(HardenedConfig(workspace=str(tmp_path)),
                              tuple(layer for layer in LAYERS if layer.name == "pid-ns"))
            sandbox.before_fork()
            sandbox.before_fork()  # the fork in between "failed"
            child = os.fork()
            if child == 0:
                os._exit(0 if os.getpid() == 1 else 1)
            sandbox.after_fork(child)
            code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


# The rest of the hostile-tool suite (tests/test_attacks.py), run as written against a hardened
# executor; and its template-rewrite hole, closed here (no parent to reach: getppid() is 0).
ATTACK_SUITE = (
    "test_a_tool_that_forges_its_reply_and_stays_never_sees_or_answers_a_later_call",
    "test_a_tool_that_patches_the_registry_changes_no_later_call",
    "test_a_thread_left_running_writes_nothing_into_the_next_call",
    "test_an_alarm_armed_for_the_next_call_never_fires_in_it",
    "test_a_worker_holds_only_stdin_stdout_stderr_and_its_channel",
    "test_the_controllers_pidfd_is_not_inherited",
    "test_no_clear_refs_descriptor_is_held",
    "test_a_50_mb_exception_type_name_arrives_cut_with_a_note",
    "test_a_50_mb_exception_message_arrives_cut_with_a_note",
    "test_40_mb_of_signals_arrive_cut_with_a_note",
    "test_40_mb_in_40000_signals_arrive_cut_with_a_note",
    "test_a_tool_cannot_rewrite_the_template_that_later_workers_are_forked_from",
    "test_a_tool_cannot_take_over_the_workers_forked_for_later_calls",
    "test_a_tool_cannot_kill_the_supervisor_or_leave_processes_behind_it",
    "test_secrets_in_the_executors_environment_are_not_in_proc_environ",
    "test_secrets_in_the_executors_environment_are_not_in_a_workers_memory",
)


@pytest.fixture(scope="module")
def hardened_attack_suite() -> Iterator[LocalExecutor]:
    local = start_attacked(profile="hardened")
    yield local
    local.stop()


@pytest.mark.parametrize("name", ATTACK_SUITE)
def test_the_hostile_tool_suite_holds_under_hardened(name: str, hardened_attack_suite: LocalExecutor,
                                                     make_client: Any, start_raw: Any, tmp_path: Path) -> None:
    def hardened_client(tools: list[str] | None = None, **options: Any) -> Any:
        return make_client(tools, profile="hardened", **options)

    def hardened_raw(**options: Any) -> Any:
        return start_raw(profile="hardened", **options)

    test = getattr(attack_suite, name)
    given = {"executor": hardened_attack_suite, "client": hardened_attack_suite.client, "tmp_path": tmp_path,
             "make_client": hardened_client, "start_raw": hardened_raw}
    test(**{k: v for k, v in given.items() if k in inspect.signature(test).parameters})


def test_workspace_rw_refuses_a_workspace_that_cannot_be_idmapped(capsys: pytest.CaptureFixture[str]) -> None:
    """sysfs takes no idmapped mount: --workspace-rw on it is refused before serving, saying why."""
    assert mounts.check_idmap(tempfile.mkdtemp()) is None  # ext4 here: fine
    assert start.start_hardened(_serve_args(workspace="/sys/kernel", workspace_rw=True)) == 1
    assert "idmapped mount" in capsys.readouterr().err


def test_the_directory_the_executor_was_started_from_is_not_in_the_view(tmp_path: Path) -> None:
    """``python -m`` puts the working directory on ``sys.path`` (often a home directory): a file
    there must stay out of the workers' view; the workspace and the tool modules' directory are in it."""
    home = Path(tempfile.mkdtemp(prefix="ciayn-home-", dir="/var/tmp"))
    try:
        home.chmod(0o755)
        (home / "secret.txt").write_text("sk-home")
        workspace = home / "ws"
        workspace.mkdir(mode=0o755)
        sockdir = Path(tempfile.mkdtemp())
        endpoint = f"ipc://{sockdir}/executor.sock"
        proc = subprocess.Popen([sys.executable, "-m", "executor.cli", "serve", "--profile", "hardened",
                                 "--skip-selfcheck", "--tools", TOOLS, "--bind", endpoint, "--workspace",
                                 str(workspace), "--parent-pid", str(os.getpid()), "--log-level", "warning"],
                                cwd=home, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
        client = None
        try:
            deadline = time.monotonic() + 30
            while not (sockdir / "executor.sock").exists():
                assert proc.poll() is None and time.monotonic() < deadline, "the executor did not start"
                time.sleep(0.02)
            client = selfcheck._Client(endpoint)
            seen = client.call("sh", {"command": f"cat {home}/secret.txt; ls -d {workspace} {Path(TOOLS).parent}"})
            assert seen.ok, seen.error
            assert "sk-home" not in seen.value["stdout"] and "No such file" in seen.value["stderr"], seen.value
            assert str(workspace) in seen.value["stdout"] and str(Path(TOOLS).parent) in seen.value["stdout"]
        finally:
            if client is not None:
                client.close()
            proc.terminate()
            proc.wait(10)
    finally:
        shutil.rmtree(home, ignore_errors=True)
