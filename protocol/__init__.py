"""The wire contract of ciayn-sandbox, shared by controller and executor.

It defines the call grammar (model text -> ``Call``), tool specs and argument binding, the message
bodies and their codec. It imports nothing from ``controller`` or ``executor``. See ``SPEC.md``.
"""

from protocol.codec import MAX_FRAME_BYTES, VERSION, ProtocolError, decode, encode
from protocol.errors import CiaynError
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
from protocol.spec import BindError, Param, ToolSpec
from protocol.values import ValueRefused, check_value

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
