"""A scripted OpenAI-compatible chat server on 127.0.0.1, for real-HTTP tests without a model.

    with LLMStub([tool_call("write_file", path="a.txt", content="hi"), "done"]) as stub:
        litellm.completion(model="openai/stub", api_base=stub.api_base, api_key="x", messages=...)
        stub.requests          # the JSON bodies received, in order

It answers ``GET /v1/models`` and ``POST /v1/chat/completions`` (plain JSON, or server-sent events
when the request asks for ``stream``). Each chat request takes the next scripted reply:

- a ``str``: an assistant text reply (``finish_reason`` ``stop``);
- a ``ToolCall`` (made by ``tool_call(name, **arguments)``) or a list of them: an assistant reply
  with those ``tool_calls`` (``finish_reason`` ``tool_calls``); a list is parallel calls;
- a ``StubError(status, message)``: an HTTP error with an OpenAI-style error body;
- a callable: called with the request body, returns any of the above.

``usage`` is always filled (about four bytes per token). When the script runs out, the reply is
HTTP 400 saying so, which fails the run at once instead of being retried. Stdlib only.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

MODEL_ID = "stub"


@dataclass(frozen=True)
class ToolCall:
    """One scripted tool call: the tool's name and its arguments (sent as a JSON string)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StubError:
    """A scripted HTTP error: ``status`` (429 and 5xx are transient to litellm and our retries)."""

    status: int
    message: str = "scripted error"


Reply = str | ToolCall | Sequence[ToolCall] | StubError | Callable[[dict[str, Any]], Any]


def tool_call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name, arguments)


def _tokens(value: Any) -> int:
    return max(1, len(json.dumps(value, ensure_ascii=False).encode("utf-8")) // 4)


class LLMStub:
    """The server; start it with ``with`` (or ``start()``/``stop()``). Thread-safe."""

    def __init__(self, replies: Sequence[Reply | Any] = (), *, model: str = MODEL_ID) -> None:
        self.replies: list[Reply] = list(replies)
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> LLMStub:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet test output
                pass

            def do_GET(self) -> None:
                if self.path.rstrip("/") in ("/v1/models", "/models"):
                    self._json(200, {"object": "list", "data": [{"id": stub.model, "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    self._json(400, {"error": {"message": "the body is not JSON", "type": "invalid_request_error"}})
                    return
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                    return
                status, payload = stub._answer(body)
                if status == 200 and body.get("stream"):
                    self._sse(payload)
                else:
                    self._json(status, payload)

            def _json(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _sse(self, payload: dict[str, Any]) -> None:
                choice = payload["choices"][0]
                message = choice["message"]
                delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
                if message.get("tool_calls"):
                    delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
                base = {k: payload[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
                chunks = [
                    {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                    {
                        **base,
                        "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
                        "usage": payload["usage"],
                    },
                ]
                data = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="llm-stub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> LLMStub:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---------------------------------------------------------------- addresses and script

    @property
    def port(self) -> int:
        assert self._server is not None, "the stub is not started"
        return int(self._server.server_address[1])

    @property
    def api_base(self) -> str:
        """The base URL for litellm's ``api_base`` (or an OpenAI client's ``base_url``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def remaining(self) -> int:
        with self._lock:
            return len(self.replies) - len(self.requests)

    def add(self, *replies: Reply) -> None:
        """Append replies to the script (also while serving)."""
        with self._lock:
            self.replies.extend(replies)

    def _answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            index = len(self.requests)
            self.requests.append(body)
            reply: Any = self.replies[index] if index < len(self.replies) else None
            serial = next(self._ids)
        if reply is None:
            message = (
                f"the LLM stub has no scripted reply left: this is request {index + 1} "
                f"and the script holds {len(self.replies)} replies"
            )
            return 400, {"error": {"message": message, "type": "invalid_request_error", "code": "stub_exhausted"}}
        if callable(reply) and not isinstance(reply, ToolCall | StubError):
            reply = reply(body)
        if isinstance(reply, StubError):
            return reply.status, {"error": {"message": reply.message, "type": "stub_error", "code": reply.status}}
        message_out: dict[str, Any]
        if isinstance(reply, str):
            message_out = {"role": "assistant", "content": reply}
            finish = "stop"
        else:
            calls = [reply] if isinstance(reply, ToolCall) else list(reply)
            if not calls or not all(isinstance(c, ToolCall) for c in calls):
                raise TypeError(f"a scripted reply must be a str, ToolCall(s) or StubError, not {reply!r}")
            message_out = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{serial}_{i}",
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                    }
                    for i, c in enumerate(calls)
                ],
            }
            finish = "tool_calls"
        prompt_tokens = _tokens(body.get("messages", []))
        completion_tokens = _tokens(message_out)
        return 200, {
            "id": f"chatcmpl-stub-{serial}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model") or self.model,
            "choices": [{"index": 0, "finish_reason": finish, "message": message_out}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
