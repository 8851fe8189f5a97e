"""The executor the attack suite (``tests/tools/attacks.py``) runs in: ``start`` through
``LocalExecutor``, and the ``start_raw`` fixture that starts ``ciayn-executor serve`` the way an operator
would (import it by name into the test module). ``test_attacks`` uses both in the default profile,
``test_hardened`` reruns the suite under ``--profile hardened``."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controller import ExecutorClient, ExecutorUnavailable, LocalExecutor

TESTS = Path(__file__).resolve().parents[1]
ATTACKS = str(TESTS / "tools" / "attacks.py")
TIMEOUT = 5.0  # the executors' wall-clock limit


def start(**options: Any) -> LocalExecutor:
    local = LocalExecutor(tools=[ATTACKS], timeout=TIMEOUT, **options)
    local.start()
    return local


@pytest.fixture
def start_raw() -> Iterator[Callable[..., LocalExecutor]]:
    """Start ``ciayn-executor serve`` the way an operator would, not through ``LocalExecutor``'s
    filtered environment and ``stdin=DEVNULL``: ``start_raw(env=..., stdin=..., preexec_fn=...,
    user=uid, pass_env=[...], **options)``. The command line is ``LocalExecutor``'s; stopped at the end."""
    started: list[LocalExecutor] = []

    def start(*, env: dict[str, str] | None = None, stdin: int = subprocess.DEVNULL,
              preexec_fn: Callable[[], None] | None = None, pass_env: list[str] | None = None,
              user: int | None = None, **options: Any) -> LocalExecutor:
        local = LocalExecutor(tools=[ATTACKS], timeout=TIMEOUT, pass_env=pass_env or (), **options)
        local.dir = Path(tempfile.mkdtemp(prefix="ciayn-attack-"))
        started.append(local)
        if user is not None:
            os.chown(local.dir, user, user)
        with open(local.log_path, "wb") as log:
            local.proc = subprocess.Popen(local.command(), stdin=stdin, stdout=log, stderr=log,
                                          env=env if env is not None else dict(os.environ),
                                          preexec_fn=preexec_fn, start_new_session=True,
                                          user=user, group=user, extra_groups=[] if user is not None else None)
        client = ExecutorClient(local.endpoint, connect_timeout=0.5)
        deadline = time.monotonic() + 60
        while True:
            assert local.proc.poll() is None, f"the executor exited\n{local.log_tail()}"
            try:
                client.tools(timeout=0.5)
                break
            except ExecutorUnavailable:
                assert time.monotonic() < deadline, f"the executor did not come up\n{local.log_tail()}"
        client.connect_timeout = 10.0
        local.client = client
        return local

    yield start
    for local in started:
        local.stop()
        if local.proc is not None and local.proc.stdin is not None:
            local.proc.stdin.close()
