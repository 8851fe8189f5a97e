"""The executor behind a test's client."""

from __future__ import annotations

from controller import ExecutorClient, LocalExecutor


def local_of(client: ExecutorClient) -> LocalExecutor:
    """The ``LocalExecutor`` a ``make_client`` fixture started for ``client`` (its process, its log)."""
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    assert local.proc is not None
    return local
