"""A per-run tool allowlist: offer an agent only the tools its task needs.

``AllowedTools(client, ["list_dir", "read_file", "complete_task"])`` wraps an executor client (any
``controller.toolclient.ToolClient``) and is one itself. Its ``tools()`` lists only
the allowed tools, so the prompt, the reply grammar and the parser know no others; its ``call()``
refuses any other tool with an ``unknown_tool`` result without sending it, so a model that guesses a
hidden tool's name still cannot run it. The executor itself keeps serving every tool to other
clients: this narrows one run, it does not reconfigure the executor.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future

from controller.toolclient import ToolClient
from protocol import Call, Result, ToolSpec
from protocol.errors import CiaynError


class UnknownTools(CiaynError, ValueError):
    """The allowlist names tools the executor does not have; ``str()`` names them and the ones it has."""


def parse_names(text: str) -> list[str]:
    """``"list_dir, read_file,complete_task"`` -> ``["list_dir", "read_file", "complete_task"]``."""
    return [name for name in (part.strip() for part in text.split(",")) if name]


class AllowedTools:
    """An executor client that offers and runs only ``names`` (in the executor's order)."""

    def __init__(self, client: ToolClient, names: Iterable[str]) -> None:
        self.client = client
        self.names = tuple(dict.fromkeys(names))
        if not self.names:
            raise ValueError("the tool allowlist is empty: name at least one tool")

    def tools(self) -> list[ToolSpec]:
        """The allowed tools; raises ``UnknownTools`` if the executor lacks any of them."""
        specs = list(self.client.tools())
        have = {s.name for s in specs}
        missing = [n for n in self.names if n not in have]
        if missing:
            raise UnknownTools(
                f"the tool allowlist names {', '.join(missing)}, which the executor does not have; "
                f"it has: {', '.join(sorted(have)) or '(no tools)'}"
            )
        return [s for s in specs if s.name in self.names]

    def submit(self, call: Call, timeout: float | None = None) -> Future[Result]:
        if call.tool not in self.names:
            refused: Future[Result] = Future()
            refused.set_result(
                Result.failure(
                    call.id or "",
                    "unknown_tool",
                    f"{call.tool} is not offered in this run; the tools are: {', '.join(self.names)}",
                )
            )
            return refused
        return self.client.submit(call, timeout=timeout)

    def call(self, call: Call, timeout: float | None = None) -> Result:
        return self.submit(call, timeout).result()

    def cancel(self, call_id: str) -> None:
        self.client.cancel(call_id)

    def __repr__(self) -> str:
        return f"AllowedTools({self.client!r}, {list(self.names)!r})"
