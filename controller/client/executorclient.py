"""``ExecutorClient``, the public face of the client: checks what callers hand it, and answers at once
what can never be sent; everything else goes to its loop (``connection.py``) as a future, run by the
caller of ``call`` itself when no other thread runs it.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future

from controller.client.connection import Connection
from controller.client.link import valid_timeout
from protocol import Call, CallRejected, Result, ToolSpec, Welcome, parse_call
from protocol.codec import valid_id
from protocol.errors import CiaynError
from protocol.messages import ID_PATTERN, MAX_TIMEOUT_S


class ExecutorUnavailable(CiaynError):
    """No executor answered in time (only ``tools()`` raises it; calls get a result instead)."""


class ExecutorClient:
    """Client of one executor or broker endpoint. Thread-safe; a context manager.

    ``insecure=True`` allows an abstract ``ipc://@name`` endpoint, whose owner cannot be checked (any
    local user can bind one first); an ``ipc://`` socket file owned by another user (not root) is
    always refused (SPEC.md, Transport)."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float | None = None,
        curve_server_key: bytes | None = None,
        curve_keys: tuple[bytes, bytes] | None = None,
        connect_timeout: float = 10.0,
        insecure: bool = False,
    ) -> None:
        if timeout is not None and not valid_timeout(timeout):
            raise ValueError(f"timeout must be a positive number of seconds up to {MAX_TIMEOUT_S:g}, not {timeout!r}")
        if endpoint.startswith("ipc://@") and not insecure:
            raise ValueError(f"cannot use executor endpoint {endpoint!r}: an abstract ipc socket has no owner to "
                             "check (any local user may bind it first); use an ipc path in a private directory, "
                             "or pass insecure=True")
        self.endpoint = endpoint
        self.default_timeout = timeout  # None: the executor's (or the tool's) own default
        self.connect_timeout = connect_timeout
        self._conn = Connection(endpoint, curve_server_key, curve_keys)  # ValueError: a bad endpoint or key
        self._conn.start()
        self._conn.post("hello", None)

    def tools(self, timeout: float | None = None) -> list[ToolSpec]:
        """The executor's tool specs (from its ``welcome``; refreshed after a restart)."""
        introduction = self._conn.introduction
        welcome = introduction.wait(self.connect_timeout if timeout is None else timeout)
        if welcome is None:
            if introduction.problem:
                raise ExecutorUnavailable(f"the executor at {self.endpoint} answered with a welcome this client "
                                          f"cannot use: {introduction.problem}")
            hint = "is `ciayn-executor serve` running there?"
            if self.endpoint.startswith("tcp://"):
                hint += (" An executor using CurveZMQ also stays silent when the keys do not match: check"
                         " the server key, and that this client's public key is in its --curve-clients dir.")
            raise ExecutorUnavailable(
                f"no executor answered at {self.endpoint} within {self.connect_timeout:g} s; {hint}"
            )
        return list(welcome.tools)

    @property
    def welcome(self) -> Welcome | None:
        return self._conn.introduction.welcome

    @property
    def alive(self) -> bool:
        """Whether the executor answered within the last few heartbeats."""
        return self._conn.link.answering(time.monotonic())

    def submit(self, call: Call, timeout: float | None = None) -> Future[Result]:
        """Send a call; the future always resolves to a Result (never an exception). A call with an
        invalid id or timeout is answered at once (``protocol``, ``bad_arguments``), never sent."""
        call, future = self._prepare(call, timeout)
        if not future.done():
            self._conn.post("call", (call, future))
        return future

    def call(self, call: Call, timeout: float | None = None) -> Result:
        """Run a call and wait for its result (on this thread, when no other runs the client's loop)."""
        call, future = self._prepare(call, timeout)
        if not future.done():
            self._conn.drive(call, future)
        return future.result()

    def _prepare(self, call: Call, timeout: float | None) -> tuple[Call, Future[Result]]:
        """The call as it is sent (its id and timeout set) and its future, already answered if the
        call can never be sent."""
        future: Future[Result] = Future()
        if call.id and valid_id(call.id) is None:
            future.set_result(Result.failure("", "protocol", f"the call was not sent: its id {call.id[:40]!r} is "
                                             f"not a valid call id ({ID_PATTERN})"))
            return call, future
        cid = call.id or uuid.uuid4().hex
        call = call.model_copy(update={"id": cid})
        if timeout is not None:
            call.timeout = timeout
        elif call.timeout is None and self.default_timeout is not None:
            call.timeout = self.default_timeout
        if call.timeout is not None and not valid_timeout(call.timeout):
            future.set_result(Result.failure(cid, "bad_arguments", f"the call was not sent: its timeout "
                                             f"{call.timeout!r} is not a number of seconds in (0, {MAX_TIMEOUT_S:g}]"))
        elif self._conn.closed:
            future.set_result(Result.failure(cid, "unavailable", "the client is closed"))
        return call, future

    def call_text(self, text: str, timeout: float | None = None) -> Result:
        """Parse one line of call text against the executor's tools and run it. A rejected text
        gives a ``rejected`` (or ``unknown_tool``/``bad_arguments``) result, nothing is sent."""
        try:
            specs = {s.name: s for s in self.tools()}
        except ExecutorUnavailable as e:
            return Result.failure("", "unavailable", str(e))
        try:
            call = parse_call(text, specs)
        except CallRejected as e:
            kind = e.code if e.code in ("unknown_tool", "bad_arguments") else "rejected"
            return Result.failure("", kind, str(e))  # type: ignore[arg-type]
        return self.call(call, timeout)

    def cancel(self, call_id: str) -> None:
        """Ask the executor to stop a call this client sent; it is answered ``cancelled``."""
        if valid_id(call_id) is not None:
            self._conn.post("cancel", call_id)

    def close(self) -> None:
        if not self._conn.closed:
            self._conn.close()

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
