"""Every text the model reads: the CIAYN instructions, result and error feedback, the repair prompt.

All of it uses real newlines (RA.Aid sent literal backslash-n sequences), says each thing once, and
is built from the executor's tool specs. ``describe_failure`` puts an executor error in plain words;
the ReAct backend uses it for its tool messages too, so both backends explain faults alike.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Sequence
from typing import Any

from protocol import Call, Result, ToolSpec

MAX_FEEDBACK_CHARS = 16_000  # a tool's value or output shown to the model is cut to this
_COMPLETION_NAME = re.compile(r"complete|finish|done", re.IGNORECASE)

INSTRUCTIONS = """\
You are an agent that completes a task by calling tools. The tools run in a separate sandbox and you \
see their results. You cannot run code yourself.

How to reply:
- Each reply is exactly one tool call written as Python, for example:
  {example}
- Write nothing else: no explanation, no markdown, no code fences, no comments.
- Arguments are literal values only: strings, numbers, True, False, None, and lists and dicts of \
those. No variables, no expressions, no nested calls.
- Write text that spans several lines as one triple-quoted string argument ({triple}).
- The result of your call comes back in the next message. Read it before choosing the next call.
- Do not repeat a call that already succeeded: its result is already in this conversation.
{bundling}- {finish}

Available tools:

{tools}"""

BUNDLING = (
    "- These tools may be sent several per reply, one call per line; they run in order and each "
    "result comes back labelled: {names}. Every other tool must be sent alone.\n"
)
TASK = "Task:\n{task}"
EMPTY_REPLY = "Your last reply was empty. Reply with exactly one tool call, for example:\n{example}"
REJECTED = "That reply was rejected and nothing was run.\n{message}"
REPEAT = (
    "{call} was not run: you just made this exact call and it succeeded, so its result is already "
    "above. Repeating it changes nothing; do something different."
)
REPAIR = """\
A model was asked to reply with exactly one tool call written as Python, and its reply was rejected.

Why it was rejected: {message}

The tools it may call:
{signatures}

Its reply:
{reply}

Rewrite the reply as exactly one valid call to one of these tools, keeping the reply's intent and \
argument values. Arguments must be literal values: strings, numbers, True, False, None, lists, \
dicts. Answer with the call only: no explanation, no markdown."""

_PLACEHOLDERS: dict[str, Any] = {
    "string": "...",
    "integer": 1,
    "number": 1.0,
    "boolean": True,
    "array": [],
    "object": {},
}


def format_call(call: Call) -> str:
    """The call as Python text: ``tool(arg, key='value')``; ``repr`` keeps every literal valid."""
    parts = [repr(a) for a in call.args] + [f"{k}={v!r}" for k, v in call.kwargs.items()]
    return f"{call.tool}({', '.join(parts)})"


def example_call(spec: ToolSpec) -> str:
    """A call of ``spec`` with a placeholder for each required argument, for the prompt."""
    properties = spec.parameters.get("properties", {})
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for p in spec.params:
        if not p.required:
            continue
        kind = properties.get(p.name, {}).get("type", "string")
        value = _PLACEHOLDERS.get(kind, "...") if isinstance(kind, str) else "..."
        if p.kind == "positional_only":
            args.append(value)
        else:
            kwargs[p.name] = value
    text = format_call(Call(tool=spec.name, args=args, kwargs=kwargs))
    return text.replace("'...'", '"..."')


def completion_tools(tools: Sequence[ToolSpec]) -> list[str]:
    """Names of the tools that, by their name, probably end the task (``complete_task``...)."""
    return [t.name for t in tools if _COMPLETION_NAME.search(t.name)]


def instructions(tools: Sequence[ToolSpec]) -> str:
    """The CIAYN instructions: rules, an example made from a real tool, and every tool's docs."""
    example_tool = next((t for t in tools if not _COMPLETION_NAME.search(t.name)), tools[0] if tools else None)
    example = example_call(example_tool) if example_tool else 'tool_name(arg="value")'
    bundleable = sorted(t.name for t in tools if t.bundleable)
    bundling = BUNDLING.format(names=", ".join(bundleable)) if bundleable else ""
    finishers = completion_tools(tools)
    if finishers:
        finish = f"When the task is done, call {' or '.join(finishers)} to report it."
    else:
        finish = "When the task is done, call the tool that reports completion."
    blocks = "\n\n".join(t.prompt_block() for t in tools) or "(no tools)"
    return INSTRUCTIONS.format(
        example=example,
        triple='content="""first line\nsecond line"""',
        bundling=bundling,
        finish=finish,
        tools=blocks,
    )


def empty_reply(tools: Sequence[ToolSpec]) -> str:
    example_tool = next((t for t in tools if not _COMPLETION_NAME.search(t.name)), tools[0] if tools else None)
    return EMPTY_REPLY.format(example=example_call(example_tool) if example_tool else 'tool_name(arg="value")')


def rejected(message: str) -> str:
    return REJECTED.format(message=message)


def repeat(call: Call) -> str:
    return REPEAT.format(call=format_call(call))


def repair_prompt(tools: Sequence[ToolSpec], reply: str, message: str) -> str:
    signatures = "\n".join(f"{t.name}{t.signature}" for t in tools) or "(no tools)"
    return REPAIR.format(message=message, signatures=signatures, reply=reply)


def _cut(text: str) -> str:
    if len(text) <= MAX_FEEDBACK_CHARS:
        return text
    return f"{text[:MAX_FEEDBACK_CHARS]}\n(cut here: {len(text) - MAX_FEEDBACK_CHARS} more characters)"


def render_value(result: Result) -> str:
    """A successful result's value (and any printed output) as text for the model."""
    value = result.value
    if value is None:
        text = "(the tool returned nothing)"
    elif isinstance(value, str):
        text = value if value else "(an empty string)"
    elif isinstance(value, bytes):
        text = value.decode("utf-8", errors="replace")
    else:
        text = json.dumps(value, ensure_ascii=False, default=repr)
    parts = [_cut(text)]
    if result.stdout.strip():
        parts.append(f"It printed:\n{_cut(result.stdout.rstrip())}")
    if result.stderr.strip():
        parts.append(f"It wrote to stderr:\n{_cut(result.stderr.rstrip())}")
    return "\n".join(parts)


def _seconds(value: float) -> str:
    return f"{value:.3g}"


def describe_failure(result: Result) -> str:
    """A failed result in plain words, as a clause: ``the tool timed out after 5 s and its worker
    was restarted; tool state was reset``. For the model, and for the transcript."""
    error = result.error
    kind = error.kind if error else "protocol"
    message = (error.message if error else "") or ""
    limits = result.limits
    detail = True
    if kind == "timeout":
        seconds = limits.timeout_s if limits else (result.stats.wall_s if result.stats else None)
        text = f"the tool timed out after {_seconds(seconds)} s" if seconds else "the tool timed out"
        detail = False
    elif kind == "crashed":
        text = "the tool crashed"
        if not message and error and error.signal:
            try:
                message = f"killed by {signal.Signals(error.signal).name}"
            except ValueError:
                message = f"killed by signal {error.signal}"
    elif kind == "memory":
        text = "the tool ran out of memory" + (f" (limit {limits.memory_mb} MB)" if limits else "")
    elif kind == "output_limit":
        text = "the tool's output was larger than allowed" + (f" ({limits.max_output_kb} KB)" if limits else "")
    elif kind == "tool_error":
        kind_name = error.type if error and error.type and error.type not in message else ""
        text = f"the tool raised {kind_name + ': ' if kind_name else 'an error: '}{message}"
        detail = False
    elif kind in ("unknown_tool", "bad_arguments", "rejected"):
        text = f"the executor refused the call: {message}"
        detail = False
    elif kind == "unserializable":
        text = "the tool returned a value that cannot be sent back as plain data"
    elif kind == "cancelled":
        text = "the call was cancelled"
    elif kind == "unavailable":
        text = "the executor is unavailable"
    else:
        text = "the executor could not handle the call"
    if detail and message:
        text += f" ({message.rstrip('.')})"
    if result.worker is not None and result.worker.restarted:
        text += " and its worker was restarted; tool state was reset"
    return text


def feedback(items: Sequence[tuple[Call, Result | str]]) -> str:
    """What the model reads after its calls ran: each call with its value, its failure in plain
    words, or (a ``str`` instead of a result) why it was not run. Several calls are numbered."""
    if len(items) == 1:
        call, outcome = items[0]
        return _one(format_call(call), outcome)
    lines = [f"Results of your {len(items)} calls, in order:"]
    for i, (call, outcome) in enumerate(items, start=1):
        lines.append(f"\n[{i}] {_one(format_call(call), outcome)}")
    return "\n".join(lines)


def _one(call_text: str, outcome: Result | str) -> str:
    if isinstance(outcome, str):
        return outcome
    if outcome.ok:
        return f"{call_text} returned:\n{render_value(outcome)}"
    return f"{call_text} failed: {describe_failure(outcome)}."
