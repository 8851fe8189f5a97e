"""The wire contract of ciayn-sandbox, shared by controller and executor.

It defines the call grammar (model text -> ``Call``), tool specs and argument binding, the message
bodies and their codec. It imports nothing from ``controller`` or ``executor``. See ``SPEC.md``.

The names below are imported when first used (PEP 562), so that a module of this package that needs
no pydantic (``values``, ``environment``, ``errors``, ``timing``) can be imported without it: the
executor's template imports those, and every megabyte it maps is copied by the kernel at each fork.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protocol.codec import MAX_FRAME_BYTES, VERSION, ProtocolError, decode, encode
    from protocol.errors import BindError, CiaynError
    from protocol.fingerprint import fingerprint, resend_key
    from protocol.grammar import CallRejected, parse_call, parse_calls, split_think, strip_markup
    from protocol.messages import (
        ERROR_KINDS,
        LATENCY_BUCKETS,
        Body,
        Bye,
        Call,
        Cancel,
        ErrorInfo,
        ErrorKind,
        ExecutorStatus,
        Heartbeat,
        Hello,
        Limits,
        Message,
        Ping,
        Pong,
        Ready,
        Report,
        Result,
        Signal,
        Stats,
        Status,
        ToolStats,
        Welcome,
        WorkerInfo,
    )
    from protocol.spec import Param, ToolSpec
    from protocol.values import ValueRefused, check_value

# Where the names are defined, the modules that need no pydantic first: a name is looked up in this
# order, so asking for ``check_value`` imports only what it needs.
_MODULES = ("protocol.errors", "protocol.values", "protocol.spec", "protocol.messages", "protocol.codec",
            "protocol.grammar", "protocol.fingerprint")

__all__ = [
    "ERROR_KINDS",
    "LATENCY_BUCKETS",
    "MAX_FRAME_BYTES",
    "VERSION",
    "BindError",
    "Body",
    "Bye",
    "Call",
    "CallRejected",
    "Cancel",
    "CiaynError",
    "ErrorInfo",
    "ErrorKind",
    "ExecutorStatus",
    "Heartbeat",
    "Hello",
    "Limits",
    "Message",
    "Param",
    "Ping",
    "Pong",
    "ProtocolError",
    "Ready",
    "Report",
    "Result",
    "Signal",
    "Stats",
    "Status",
    "ToolSpec",
    "ToolStats",
    "ValueRefused",
    "Welcome",
    "WorkerInfo",
    "check_value",
    "decode",
    "encode",
    "fingerprint",
    "parse_call",
    "parse_calls",
    "resend_key",
    "split_think",
    "strip_markup",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        for home in _MODULES:
            value = vars(importlib.import_module(home)).get(name, _MISSING)
            if value is not _MISSING:
                globals()[name] = value  # once: later lookups do not come here
                return value
    raise AttributeError(f"module 'protocol' has no attribute {name!r}")


_MISSING = object()
