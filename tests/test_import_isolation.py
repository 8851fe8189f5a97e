"""The dependency direction ``controller -> protocol <- executor`` holds.

A hardened executor image should stay small, so the executor never imports the controller or the model
stack (litellm, langchain, langgraph); the protocol imports neither side. Checked twice: by importing
in a fresh interpreter and looking at ``sys.modules``, and statically over the source files (so an
import hidden in a function body that the first check never runs is caught too).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_STACK = ("litellm", "langchain", "langgraph")  # prefixes: langchain_core, langgraph_prebuilt, ...


def _is_forbidden(module: str, forbidden: tuple[str, ...]) -> bool:
    top = module.split(".")[0]
    return any(top == name or (name in MODEL_STACK and top.startswith(name)) for name in forbidden)


def _modules_after(code: str) -> list[str]:
    """The names in ``sys.modules`` after running ``code`` in a fresh interpreter at the project root."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{probe}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    modules: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return modules


def test_forbidden_name_matching() -> None:
    forbidden = ("controller", *MODEL_STACK)
    assert _is_forbidden("langchain_core.messages", forbidden)
    assert _is_forbidden("langgraph", forbidden)
    assert _is_forbidden("controller.client", forbidden)
    assert not _is_forbidden("controllers_of_my_own", ("controller",))
    assert not _is_forbidden("executor", forbidden)


EVERY_EXECUTOR_MODULE = (
    "import importlib, pkgutil, executor\n"
    "for m in pkgutil.walk_packages(executor.__path__, 'executor.'):\n"
    "    importlib.import_module(m.name)"
)


@pytest.mark.parametrize(
    ("code", "expected", "forbidden"),
    [
        pytest.param("import executor", "executor", ("controller", *MODEL_STACK), id="executor"),
        pytest.param(EVERY_EXECUTOR_MODULE, "executor.supervisor", ("controller", *MODEL_STACK), id="executor-all"),
        pytest.param("import protocol", "protocol", ("executor", "controller", *MODEL_STACK), id="protocol"),
    ],
)
def test_import_pulls_in_nothing_forbidden(code: str, expected: str, forbidden: tuple[str, ...]) -> None:
    modules = _modules_after(code)
    assert expected in modules
    assert [m for m in modules if _is_forbidden(m, forbidden)] == []


def test_a_template_maps_no_pydantic() -> None:
    """Every fresh worker is a fork of the template, and the kernel copies the page tables of all the
    template maps at each fork and tears them down at each exit: pydantic's machinery alone is about
    8 MB, which made a fork+exit+wait 2.5 times dearer. What a template imports (its entry, the far
    side of the fork, and the registry finding the built-in and shell toolkits) loads no pydantic and
    no protocol module that needs it: tool specs are described in a child of the template."""
    modules = _modules_after("import executor.workers.template\n"
                             "from executor.registry import find_tools\n"
                             "find_tools(['executor.toolkits.builtin', 'executor.toolkits.shell'])")
    assert "executor.workers.worker" in modules and "executor.toolkits.shell" in modules
    heavy = ("pydantic", "pydantic_core", "protocol.messages", "protocol.spec", "protocol.codec", "zmq")
    assert [m for m in modules if _matches(m, heavy)] == []


def test_the_protocol_package_imports_its_names_when_first_used() -> None:
    """``import protocol.values`` (what the template needs) loads no pydantic, yet every name of
    ``protocol.__all__`` resolves, to the object its module defines, and the names the type checker
    is told about (the ``TYPE_CHECKING`` imports) are exactly ``__all__``."""
    assert [m for m in _modules_after("import protocol.values, protocol.environment, protocol.errors")
            if _matches(m, ("pydantic", "protocol.messages"))] == []
    import protocol

    tree = ast.parse((ROOT / "protocol" / "__init__.py").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    told = {alias.name: node.module for node in guarded.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}
    assert set(told) == set(protocol.__all__)
    for name, module in told.items():
        assert getattr(protocol, name) is getattr(sys.modules[str(module)], name), name
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        protocol.nonexistent  # noqa: B018


def test_the_probe_would_see_a_leak() -> None:
    """Guard against a probe that can never fail: a model-stack module in sys.modules is seen."""
    modules = _modules_after("import sys, types\nsys.modules['langchain_core'] = types.ModuleType('langchain_core')")
    assert [m for m in modules if _is_forbidden(m, MODEL_STACK)] == ["langchain_core"]


def _imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """Every module ``path`` imports, anywhere in the file: ``import``/``from`` statements (relative
    ones resolved) and ``importlib.import_module("...")``/``__import__("...")`` with a literal name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: max(0, len(package.split(".")) - node.level + 1)]
                target = ".".join([*base, node.module] if node.module else base)
                if node.module is None:
                    found += [(node.lineno, ".".join([*base, alias.name])) for alias in node.names]
                else:
                    found.append((node.lineno, target))
            else:
                found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            first = node.args[0]
            if name in ("import_module", "__import__") and isinstance(first, ast.Constant):
                found.append((node.lineno, str(first.value)))
    return [(line, module.lstrip(".")) for line, module in found]


def _package_of(path: Path) -> str:
    """The package relative imports in ``path`` start from (``__package__``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts.pop()  # the module itself; for an __init__ the rest is the package too
    return ".".join(parts)


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        pytest.param("executor", ("controller", *MODEL_STACK), id="executor"),
        pytest.param("protocol", ("executor", "controller", *MODEL_STACK), id="protocol"),
    ],
)
def test_no_source_file_imports_a_forbidden_module(package: str, forbidden: tuple[str, ...]) -> None:
    assert _offending(package, lambda module: _is_forbidden(module, forbidden), at_least=1) == []


def _offending(folder: str, forbidden: Callable[[str], bool], at_least: int) -> list[str]:
    """``file:line: module`` for every import under ``folder`` (at least ``at_least`` files) that
    ``forbidden`` refuses."""
    files = sorted((ROOT / folder).rglob("*.py"))
    assert len(files) >= at_least, f"{len(files)} sources under {folder}/"
    return [f"{path.relative_to(ROOT)}:{line}: {module}" for path in files
            for line, module in _imported_modules(path, _package_of(path)) if forbidden(module)]


def test_the_static_check_finds_every_import_form(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        "import os, litellm\n"
        "from langchain_core.messages import AIMessage\n"
        "def later():\n"
        "    import controller.client\n"
        "    from .. import controller\n"
        "    importlib.import_module('langgraph.prebuilt')\n"
        "    __import__('litellm')\n"
    )
    modules = sorted(m for _, m in _imported_modules(source, "executor.toolkits"))
    assert modules == [
        "controller.client",
        "executor.controller",  # relative: executor's own module of that name, not the controller
        "langchain_core.messages",
        "langgraph.prebuilt",
        "litellm",
        "litellm",
        "os",
    ]
    forbidden = ("controller", *MODEL_STACK)
    assert [m for m in modules if _is_forbidden(m, forbidden)] == modules[:1] + modules[2:6]


# The far side of the fork (executor/workers/): the template and the workers it forks never hold a ZeroMQ
# context, an event loop, threads or logging handlers (they would carry them, and their locks, into every
# worker), never validate with pydantic themselves, and never import the supervisor's side. Nor the hardened
# profile: it is passed in as a ``Confinement`` (executor/workers/confinement.py), so a default template
# carries none of its code.
WORKER_SIDE_FORBIDDEN = (
    "zmq", "asyncio", "threading", "logging.handlers", "pydantic", "concurrent", "executor.sandbox",
    "executor.supervisor", "executor.pool", "executor.slot", "executor.keeper", "executor.clientside",
    "executor.broker",
    "executor.calls", "executor.cli", "executor.status", "executor.metrics", "executor.fairqueue",
    "controller", *MODEL_STACK,
)


def _matches(module: str, names: tuple[str, ...]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names) or _is_forbidden(module, MODEL_STACK)


def test_the_workers_package_imports_nothing_of_the_supervisors_side() -> None:
    assert _offending("executor/workers", lambda module: _matches(module, WORKER_SIDE_FORBIDDEN), at_least=6) == []


def test_importing_every_workers_module_starts_no_zeromq_or_event_loop() -> None:
    modules = _modules_after(
        "import importlib, pkgutil, executor.workers\n"
        "for m in pkgutil.walk_packages(executor.workers.__path__, 'executor.workers.'):\n"
        "    importlib.import_module(m.name)")
    assert "executor.workers.worker" in modules
    assert [m for m in modules if m.split(".")[0] in ("zmq", "asyncio") or m.startswith("executor.supervisor")] == []
    assert [m for m in modules if m.startswith("executor.sandbox")] == []


# The hardened profile (executor/sandbox/) runs in the template and the workers it forks (profile, layers,
# keeper, the selfcheck's attempts) or gates the start in the CLI's process (start, selfcheck): no event loop,
# nothing of the supervisor's side. Only the selfcheck's judge speaks ZeroMQ: it is a client of the hardened
# executor it starts, and no template or worker imports it.
SANDBOX_FORBIDDEN = (
    "zmq", "asyncio", "executor.supervisor", "executor.pool", "executor.slot", "executor.clientside",
    "executor.broker", "executor.calls", "executor.keeper", "executor.cli", "controller", *MODEL_STACK,
)
SANDBOX_ZMQ_CLIENT = "executor/sandbox/selfcheck.py:"


def test_the_sandbox_imports_nothing_of_the_supervisors_side() -> None:
    offending = _offending("executor/sandbox", lambda module: _matches(module, SANDBOX_FORBIDDEN), at_least=10)
    assert [o for o in offending if not (o.startswith(SANDBOX_ZMQ_CLIENT) and o.endswith(": zmq"))] == []


def test_what_a_template_loads_of_the_sandbox_starts_no_zeromq() -> None:
    """A template restores its profile from ``executor.sandbox.profile`` (``Confinement`` from_wire), and the
    selfcheck's executor imports ``executor.sandbox.attempts`` as its tools: neither loads ZeroMQ, an event
    loop, the supervisor's side or the selfcheck's judge."""
    modules = _modules_after("import executor.sandbox.profile, executor.sandbox.attempts")
    assert "executor.sandbox.layers" in modules and "executor.sandbox.keeper" in modules
    above = ("executor.supervisor", "executor.pool", "executor.clientside", "executor.sandbox.selfcheck",
             "executor.sandbox.start")
    assert [m for m in modules if m.split(".")[0] in ("zmq", "asyncio") or _matches(m, above)] == []


def _executor_graph() -> dict[str, set[str]]:
    """Module -> the executor modules it imports (anywhere in the file), from the sources."""
    sources = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (ROOT / "executor").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        edges: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # ``from executor.workers import framing`` imports the module executor.workers.framing
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in sources else node.module
                           for alias in node.names]
            edges |= {t for t in targets if t in sources and t != name}
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle in ``graph`` (a list of modules, the first repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_import_circle_in_the_executor() -> None:
    """A package's __init__ importing its own modules is no circle; any other loop is (the one that was held
    open by late imports: hardening -> overlay -> worker -> hardening, now executor/sandbox/)."""
    graph = _executor_graph()
    for package in ("executor", "executor.workers", "executor.toolkits"):  # an __init__'s re-exports
        graph[package] = set()
    assert len(graph) > 30
    assert _cycle(graph) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_the_client_side_knows_nothing_of_workers_or_the_call_table() -> None:
    """executor/clientside/ (a bound ROUTER, a link to a broker) only moves messages: it imports no worker,
    pool, call table, supervisor or broker module."""
    below = ("executor.workers", "executor.pool", "executor.calls", "executor.supervisor", "executor.broker",
             "executor.sandbox")
    assert _offending("executor/clientside", lambda module: _matches(module, below), at_least=3) == []


def test_the_broker_stands_apart_from_the_executor_that_runs_calls() -> None:
    """executor/broker/ fronts a pool of executors: nothing else under executor/ imports it but the command
    line that starts it, and it imports nothing that runs calls: no worker pool, supervisor, hardened profile,
    tool registry or far side of the fork (the one rule for a call's timeout that both apply,
    ``requested_timeout``, is the protocol's)."""
    users = _offending("executor", lambda module: _matches(module, ("executor.broker",)), at_least=30)
    assert [u for u in users if not u.startswith(("executor/broker/", "executor/cli.py:"))] == []
    assert _offending("executor/broker", lambda module: _matches(module, BROKER_FORBIDDEN), at_least=7) == []


BROKER_FORBIDDEN = ("executor.pool", "executor.slot", "executor.supervisor", "executor.keeper", "executor.workers",
                    "executor.sandbox", "executor.registry", "executor.toolkits", "executor.clientside.brokerlink")


# controller/client/ (the executor client: its connection, the call link, the calls in flight) speaks the
# protocol over ZeroMQ and nothing more, so that a program which only calls tools can take it alone: its
# imports are the standard library, zmq, protocol and its own modules. msgpack and pydantic reach it only
# through protocol; no other controller module (agent, models, the local executor), no executor module,
# no model stack.
CLIENT_ALLOWED = ("protocol", "zmq", "controller.client")


def _client_may_import(module: str) -> bool:
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or any(module == name or module.startswith(name + ".")
                                                  for name in CLIENT_ALLOWED)


def test_the_executor_client_imports_only_the_protocol_zeromq_and_the_stdlib() -> None:
    assert _offending("controller/client", lambda module: not _client_may_import(module), at_least=5) == []


def test_the_client_rule_refuses_the_rest_of_the_controller_and_the_executor() -> None:
    assert _client_may_import("controller.client.link") and _client_may_import("protocol.codec")
    assert _client_may_import("zmq.asyncio") and _client_may_import("concurrent.futures")
    assert not any(_client_may_import(m) for m in ("controller.local", "controller", "controller.clients",
                                                   "executor.pool", "msgpack", "pydantic", "litellm"))


@pytest.mark.parametrize("table", ["WORKER_SIDE_FORBIDDEN", "SANDBOX_FORBIDDEN", "BROKER_FORBIDDEN",
                                   "CLIENT_ALLOWED"])
def test_every_project_module_a_rule_names_exists(table: str) -> None:
    """A rule naming a module that moved forbids nothing: each project module named must be a file or a
    package of the tree (the worker side's ``executor.journal`` did, for as long as it named it)."""
    names = [n for n in globals()[table] if n.split(".")[0] in ("executor", "controller", "protocol")]
    stale = [n for n in names if not any((ROOT / n.replace(".", "/")).with_suffix(s).exists() for s in (".py", ""))]
    assert names and stale == []
