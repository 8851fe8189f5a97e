"""Shared fixtures: real executors on real sockets, always cleaned up."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

# Before anything can import litellm: no network at run time.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The embedded model's llama.cpp server (started by tests, inheriting this environment) parks its
# OpenMP threads instead of spinning: spinning threads beside a parallel suite on two cores slow it
# (and every test beside it) several times over, into timeouts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from controller import ExecutorClient, LocalExecutor
from tests.support.processes import alive

TESTS = Path(__file__).parent
FAULTY = str(TESTS / "tools" / "faulty.py")
BUILTIN = "executor.toolkits.builtin"
CIAYN_TOOLS = str(TESTS / "tools" / "ciayn_tools.py")  # agent-loop tools: side effects in calls.log


# Under pytest-xdist with ``--dist loadfile`` (``scripts/test``) each test module is one unit of work, run
# on one worker, so its module-scoped fixtures start once. Modules that must never run at the same time
# as each other form one unit together, named here. (pytest-xdist's own ``--dist loadgroup`` with
# ``xdist_group`` marks does not group on pytest 9.2: pytest-xdist issue 1386.)
EXCLUSIVE_GROUPS = {
    # each starts the embedded model's llama.cpp server: two at once on two cores starve each other
    "embedded-model": ("test_demo.py", "test_local_model.py", "test_local_e2e.py"),
    # the hardened ones check that an executor left nothing on the host by diffing the host's mounts,
    # /dev/shm or the overlay applier's names in /tmp before and after it (one another's executors
    # would show up); the netns test mounts named network namespaces on the host meanwhile
    "host-mounts": ("test_hardened.py", "test_hardened_quota.py", "test_broker_netns.py", "test_overlay_apply.py",
                    "test_overlay_redteam.py", "test_ci_recipe.py"),
}
# Units that take longest, started first so that no worker is left with one of them at the end while
# the others idle. Only an order: a name missing here costs balance, never correctness.
LONG_UNITS_FIRST = ("embedded-model", "host-mounts", "test_gbnf.py", "test_cli_usage.py", "test_bench.py")
_GROUP_OF = {module: group for group, modules in EXCLUSIVE_GROUPS.items() for module in modules}


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its module's file name, or the group that module is in."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return _GROUP_OF.get(module, module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``: one unit of work per module or named group, in ``LONG_UNITS_FIRST`` order
    and then in collection order."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # the order is the collection's, arranged below
    return ModuleGroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker: the units in ``LONG_UNITS_FIRST`` first (a stable sort, so each
    module's tests keep their order and every worker collects the same order)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return
    rank = {unit: i for i, unit in enumerate(LONG_UNITS_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """An empty workspace directory for an executor's file tools."""
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


def log_lines(workspace: Path) -> list[str]:
    """The lines tests/tools/ciayn_tools.py logged in ``workspace`` (which calls ran, in order)."""
    path = workspace / "calls.log"
    return path.read_text().splitlines() if path.exists() else []


def require_layer(present: bool, reason: str) -> None:
    """Skip a test whose defense layer (control groups, ...) this machine does not offer, except where
    CI runs as root with cgroups mounted (``CI=true``): there the layer must be present, so a broken
    detection fails the suite instead of hiding behind a skip."""
    if present:
        return
    if os.environ.get("CI") == "true" and os.geteuid() == 0 and _cgroups_mounted():
        pytest.fail(f"{reason}; CI runs as root with cgroups mounted, so this layer must be present")
    pytest.skip(reason)


def nspid(pid: int) -> list[int]:
    """A process's pids, the host's first, then one per nested PID namespace (``NSpid``); [] if gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return [int(p) for p in line.split()[1:]]
    except OSError:
        pass
    return []


def template_of(supervisor: int) -> int:
    """The host pid of an executor's template: the supervisor's child that is PID 1 of its own
    namespace, or (where the executor could not make one) its only child running Python; 0 if none."""
    try:
        children = psutil.Process(supervisor).children()
    except psutil.NoSuchProcess:
        return 0
    for child in children:
        if nspid(child.pid)[1:2] == [1]:
            return child.pid
    return children[0].pid if len(children) == 1 else 0


def host_pid(supervisor: int, pid: int) -> int:
    """The host pid of the live process of an executor (supervisor ``supervisor``) that a tool knows
    as ``pid``: its pid in the template's PID namespace, where workers run in one (otherwise the host
    pid itself); 0 if no such process lives. Tools see only their namespace, tests the host."""
    template = template_of(supervisor)
    if template and nspid(template)[1:2] != [1]:  # no namespace: a tool's pid is the host's
        return pid if alive(pid) else 0
    try:
        tree = psutil.Process(supervisor).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    for p in tree:
        ids = nspid(p.pid)
        if len(ids) >= 2 and ids[1] == pid and alive(p.pid):
            return p.pid
    return 0


def pid_namespaces() -> bool:
    """Whether executors here run their workers in a PID namespace of their own (as root they do)."""
    return os.geteuid() == 0


def _cgroups_mounted() -> bool:
    try:
        with open("/proc/mounts") as f:
            return any(len(fields) > 2 and fields[2] in ("cgroup", "cgroup2") for fields in map(str.split, f))
    except OSError:
        return False


@pytest.fixture
def make_client() -> Iterator[Callable[..., ExecutorClient]]:
    """Start a real executor (``ciayn-executor serve`` on a private ipc endpoint) and return a
    connected client: ``make_client(tools=[module or path, ...], workspace=..., timeout=..., ...)``.
    Every executor started is stopped at the end of the test."""
    started: list[LocalExecutor] = []

    def make(tools: list[str] | None = None, **options: object) -> ExecutorClient:
        local = LocalExecutor(tools=tools or [FAULTY], **options)  # type: ignore[arg-type]
        client = local.start()
        client.local = local  # type: ignore[attr-defined]
        started.append(local)
        return client

    yield make
    for local in started:
        local.stop()


@pytest.fixture
def executor_pids() -> Callable[[ExecutorClient], list[int]]:
    """All pids of an executor started by ``make_client``: supervisor, template, workers, leftovers."""

    def pids(client: ExecutorClient) -> list[int]:
        local: LocalExecutor = client.local  # type: ignore[attr-defined]
        assert local.proc is not None
        root = psutil.Process(local.proc.pid)
        return [root.pid] + [p.pid for p in root.children(recursive=True)]

    return pids


@pytest.fixture
def dealer() -> Iterator[Callable[..., zmq.Socket[bytes]]]:
    """A raw DEALER socket connected to an endpoint, as a client in another language would have:
    ``dealer(endpoint, routing_id=b"...")``; receives time out after 10 s. Closed at the end."""
    ctx = zmq.Context()
    made: list[zmq.Socket[bytes]] = []

    def make(endpoint: str, routing_id: bytes | None = None) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.connect(endpoint)
        made.append(sock)
        return sock

    yield make
    for sock in made:
        sock.close(0)
    ctx.term()
