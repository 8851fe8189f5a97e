"""``ToolClient``: the one executor seam both agent backends are written against.

``ExecutorClient`` (one executor or broker endpoint), ``LocalExecutor`` (a private executor it starts),
``AllowedTools`` (a per-run narrowing of another client) and the in-process fakes of tests implement
it. An agent lists the tools once per run, sends each call with ``submit`` and waits on the future,
so a stop can ``cancel`` the call in flight at the executor instead of waiting for it to end.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, runtime_checkable

from protocol import Call, Result, ToolSpec


@runtime_checkable
class ToolClient(Protocol):
    """What an agent needs of an executor. ``submit``'s future always resolves to a ``Result`` (an
    executor fault is a result, never an exception); ``cancel`` asks the executor to stop a call in
    flight, which then resolves as ``cancelled``; ``call`` is ``submit(...).result()``."""

    def tools(self) -> list[ToolSpec]: ...

    def submit(self, call: Call, timeout: float | None = None) -> Future[Result]: ...

    def call(self, call: Call, timeout: float | None = None) -> Result: ...

    def cancel(self, call_id: str) -> None: ...
