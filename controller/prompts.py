"""Every text the model reads: the CIAYN instructions, example turns, result and error feedback, the
repair prompt.

All of it uses real newlines (RA.Aid sent literal backslash-n sequences), says each thing once, and
is built from the executor's tool specs. ``describe_failure`` puts an executor error in plain words;
the ReAct backend uses it for its tool messages too, so both backends explain faults alike.

Two prompt styles: ``instructions`` (full rules and docstrings, for capable models) and
``compact_instructions`` (a few lines and one line per tool, for small local models whose prompt
evaluation is slow and whose attention is short). ``example_turns`` are few-shot user/assistant turns
(a task, each call, its result in the exact feedback format, and the completion call); small models
follow a demonstrated loop far better than described rules.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol import Call, CallRejected, Result, ToolSpec, parse_call

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

COMPACT_INSTRUCTIONS = """\
You do a task by calling tools. Reply with exactly one tool call written in Python and nothing \
else, for example:
{example}
Arguments are literal values. The result comes back in the next message; read it, then make the \
next call. Never repeat a call. {finish}

Tools:
{tools}"""

BUNDLING = (
    "- These tools may be sent several per reply, one call per line; they run in order and each "
    "result comes back labelled: {names}. Every other tool must be sent alone.\n"
)
TASK = "Task:\n{task}"
EMPTY_REPLY = "Your last reply was empty. Reply with exactly one tool call, for example:\n{example}"
REJECTED = "That reply was rejected and nothing was run.\n{message}"
REPEATED = (
    "You already made {this} at step {steps} and got the same result{s}: repeating a call changes nothing. "
    "Use what you have and do the next step of the task{finish}."
)
KEPT_OUT = "Your next reply may not call {calls}."
INCOMPLETE = "{call} was not run: {missing}. {hint}"
ANSWER_SEEN = "That is what the task asks for: call {finish} with it now."
UNEXPLORED = "Not looked at yet: {names}. Next, try {example}."
MAX_NAMED = 8  # names listed in a suggestion
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


def _first_example_tool(tools: Sequence[ToolSpec]) -> ToolSpec | None:
    return next((t for t in tools if not _COMPLETION_NAME.search(t.name)), tools[0] if tools else None)


def _finish_rule(tools: Sequence[ToolSpec]) -> str:
    finishers = completion_tools(tools)
    if finishers:
        return f"When the task is done, call {' or '.join(finishers)} to report it."
    return "When the task is done, call the tool that reports completion."


def instructions(tools: Sequence[ToolSpec]) -> str:
    """The CIAYN instructions: rules, an example made from a real tool, and every tool's docs."""
    example_tool = _first_example_tool(tools)
    example = example_call(example_tool) if example_tool else 'tool_name(arg="value")'
    bundleable = sorted(t.name for t in tools if t.bundleable)
    bundling = BUNDLING.format(names=", ".join(bundleable)) if bundleable else ""
    blocks = "\n\n".join(t.prompt_block() for t in tools) or "(no tools)"
    return INSTRUCTIONS.format(
        example=example,
        triple='content="""first line\nsecond line"""',
        bundling=bundling,
        finish=_finish_rule(tools),
        tools=blocks,
    )


def compact_instructions(tools: Sequence[ToolSpec]) -> str:
    """Short CIAYN instructions for small models: the core rules, then one line per tool (its
    signature and the first sentence of its docstring). No bundling: small models do better with
    one call per reply."""
    example_tool = _first_example_tool(tools)
    example = example_call(example_tool) if example_tool else 'tool_name(arg="value")'
    lines = [f"{t.name}{t.signature}: {_first_sentence(t.doc)}".rstrip(": ") for t in tools]
    return COMPACT_INSTRUCTIONS.format(
        example=example, finish=_finish_rule(tools), tools="\n".join(lines) or "(no tools)"
    )


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return match.group(1) if match else text


@dataclass(frozen=True)
class Example:
    """A demonstrated run for few-shot prompting: a task, then each call (as the model should write
    it) with the value it returned; the last call ends the task and has no result."""

    task: str
    steps: tuple[tuple[str, Any], ...]


_LISTER = re.compile(r"list|ls$|dir", re.IGNORECASE)
_READER = re.compile(r"read|cat$|open|view|show", re.IGNORECASE)
_WRITER = re.compile(r"write|save|create", re.IGNORECASE)


def _text_params(spec: ToolSpec) -> tuple[list[str], int]:
    """``spec``'s named text parameters (required ones first) and how many are required; no
    parameters when a required one is not text (no made-up example can be given for it)."""
    properties = spec.parameters.get("properties", {})
    required: list[str] = []
    optional: list[str] = []
    for p in spec.params:
        if p.kind.startswith("var_") or p.kind == "positional_only":
            continue
        is_text = properties.get(p.name, {}).get("type") in (None, "string")
        if p.required and not is_text:
            return [], 0
        if is_text:
            (required if p.required else optional).append(p.name)
    return required + optional, len(required)


def _example(spec: ToolSpec, *values: str) -> str | None:
    """A call of ``spec`` giving ``values`` to its text parameters by keyword, required ones first;
    None when ``spec`` cannot take them."""
    names, required = _text_params(spec)
    if not required <= len(values) <= len(names):
        return None
    return format_call(Call(tool=spec.name, kwargs=dict(zip(names, values, strict=False)))).replace("'", '"')


def _pick(tools: Sequence[ToolSpec], pattern: re.Pattern[str], arity: int) -> ToolSpec | None:
    values = ["x"] * arity
    return next((t for t in tools if pattern.search(t.name) and _example(t, *values) is not None), None)


def generated_examples(tools: Sequence[ToolSpec]) -> tuple[Example, ...]:
    """Demonstrated runs made from the tools actually offered, with their real parameter names: list
    the workspace, read the file the task names and report a line of it; and write a file with given
    text. A part whose kind of tool is not offered is left out; with no completion tool, none.

    A 135M model copies shapes far better than it follows rules, so the shapes shown are those of
    the tasks users try first (scripts/eval_local_model.py measures five)."""
    finisher = next((t for t in tools if _COMPLETION_NAME.search(t.name) and _example(t, "x")), None)
    if finisher is None:
        return ()
    lister = _pick(tools, _LISTER, 1)
    reader = _pick(tools, _READER, 1)
    writer = _pick(tools, _WRITER, 2)
    examples: list[Example] = []
    if reader is not None:
        steps: list[tuple[str, Any]] = []
        task = "Read config.ini, then call {finish} with the port line from it."
        if lister is not None:
            steps.append((_example(lister, ".") or "", ["config.ini", "src/"]))
            task = "List the workspace, read config.ini, then call {finish} with the port line from it."
        steps.append((_example(reader, "config.ini") or "", "[server]\nport = 8080\n"))
        steps.append((_example(finisher, "port = 8080") or "", None))
        examples.append(Example(task=task.format(finish=finisher.name), steps=tuple(steps)))
    if writer is not None:
        examples.append(
            Example(
                task=f"Write the text 'all good' to status.txt, then call {finisher.name}.",
                steps=(
                    (_example(writer, "status.txt", "all good") or "", "wrote 8 characters to status.txt"),
                    (_example(finisher, "Wrote status.txt.") or "", None),
                ),
            )
        )
    return tuple(examples)


def example_turns(tools: Sequence[ToolSpec], examples: Sequence[Example] | None = None) -> list[dict[str, str]]:
    """Few-shot turns (user task, assistant call, user result, ..., assistant completion call) for
    each example (default: ``generated_examples(tools)``) whose every call is valid for ``tools``;
    an example that uses a tool this run does not offer is left out (so the result may be empty).
    Results use the real feedback format."""
    turns: list[dict[str, str]] = []
    by_name = {t.name: t for t in tools}
    for example in generated_examples(tools) if examples is None else examples:
        try:
            calls = [parse_call(text, by_name) for text, _ in example.steps]
        except CallRejected:
            continue
        turns.append({"role": "user", "content": TASK.format(task=example.task)})
        for call, (text, value) in zip(calls, example.steps, strict=True):
            turns.append({"role": "assistant", "content": text})
            if value is not None:
                turns.append(
                    {"role": "user", "content": feedback([(call, Result(id="example", ok=True, value=value))])}
                )
    return turns


def empty_reply(tools: Sequence[ToolSpec]) -> str:
    example_tool = _first_example_tool(tools)
    return EMPTY_REPLY.format(example=example_call(example_tool) if example_tool else 'tool_name(arg="value")')


def rejected(message: str) -> str:
    return REJECTED.format(message=message)


def progress_note(
    tools: Sequence[ToolSpec],
    repeated: Sequence[tuple[Call, int]] = (),
    kept_out: Sequence[Call] = (),
    unexplored: Sequence[str] = (),
    can_finish: bool = True,
) -> str:
    """The note after a step that got nowhere (``controller.progress``): the calls that got a result
    they had got before (with the step it was first got), the calls the next reply may not make, and
    a next call made from what the run has seen but not looked at (``unexplored`` names), or else
    the completion tool when ``can_finish``."""
    finishers = completion_tools(tools) if can_finish else []
    parts = []
    if repeated:
        steps = sorted({step for _, step in repeated})
        parts.append(
            REPEATED.format(
                this="this call" if len(repeated) == 1 else "these calls",
                steps=" and ".join(str(n) for n in steps),
                s="" if len(repeated) == 1 else "s",
                finish=f", or call {' or '.join(finishers)} if it is done" if finishers else "",
            )
        )
    if kept_out:
        parts.append(KEPT_OUT.format(calls=" or ".join(format_call(c) for c in kept_out)))
    suggestion = _next_call(tools, unexplored)
    if suggestion:
        names = ", ".join(unexplored[:MAX_NAMED]) + (", ..." if len(unexplored) > MAX_NAMED else "")
        parts.append(UNEXPLORED.format(names=names, example=suggestion))
    return " ".join(parts)


def _next_call(tools: Sequence[ToolSpec], names: Sequence[str]) -> str | None:
    """A call that looks at the first of ``names`` that an offered tool can look at: a listing tool
    for a directory (a name ending in "/"), a reading tool for anything else."""
    for name in names:
        pattern, value = (_LISTER, name.rstrip("/")) if name.endswith("/") else (_READER, name)
        tool = next((t for t in tools if pattern.search(t.name) and _example(t, value) is not None), None)
        if tool is not None:
            return _example(tool, value)
    return None


def incomplete(
    call: Call, missing: str, tools: Sequence[ToolSpec], write_to: str = "", look_at: Sequence[str] = ()
) -> str:
    """Why a completion call was not run: what the task still lacks (``missing``), and what to call
    first: a writing tool for ``write_to`` when given, else a look at the first of ``look_at`` (or a
    listing of the workspace) that an offered tool can take."""
    writer = next((t for t in tools if _WRITER.search(t.name) and _text_params(t)[1] >= 1), None)
    if write_to and writer is not None:
        names = _text_params(writer)[0]
        rest = f" and the {names[1]} to write" if len(names) > 1 else ""
        hint = f"Call {writer.name} first, with {names[0]}={json.dumps(write_to)}{rest}."
    else:
        first = _next_call(tools, [*look_at, "./"])
        hint = f"Do the task first, for example {first}." if first else "Do the task first."
    return INCOMPLETE.format(call=format_call(call), missing=missing, hint=hint)


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
    if result.value_is_repr:
        parts.insert(0, "(The tool returned an object that is not plain data; this is its repr(), as text.)")
    if result.stdout.strip():
        parts.append(f"It printed:\n{_cut(result.stdout.rstrip())}")
    if result.stderr.strip():
        parts.append(f"It wrote to stderr:\n{_cut(result.stderr.rstrip())}")
    return "\n".join(parts)


def _size(value: Any) -> str:
    """How many entries a list has, or lines a text: counted here, since small models cannot count."""
    if isinstance(value, list):
        return f" {len(value)} {'entry' if len(value) == 1 else 'entries'}"
    lines = len(value.splitlines()) if isinstance(value, str) else 0
    return f" {lines} lines" if lines > 1 else ""


def describe_failure(result: Result) -> str:
    """A failed result in plain words, as a clause: ``the tool timed out after 5 s and its worker
    was restarted; tool state was reset``. For the model, and for the transcript."""
    error = result.error
    kind = error.kind if error else "protocol"
    message = (error.message if error else "") or ""
    limits = result.limits
    detail = True
    if kind == "timeout":
        # How long it ran, when measured (a queued call's limits.timeout_s is only what was left of it).
        stats = result.stats
        seconds = stats.wall_s if stats and stats.wall_s else (limits.timeout_s if limits else None)
        if seconds and limits and abs(seconds - limits.timeout_s) <= 0.1 * limits.timeout_s:
            seconds = limits.timeout_s  # it ran into its limit: 0.99 s of a 1 s timeout is "after 1 s"
        text = f"the tool timed out after {seconds:.2g} s" if seconds else "the tool timed out"
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
        return f"{call_text} returned{_size(outcome.value)}:\n{render_value(outcome)}"
    return f"{call_text} failed: {describe_failure(outcome)}."
