"""The run transcript: step events rendered for a person (rich), or as JSON lines for programs.

At a terminal a live status line under the transcript shows the step, what is in flight (the model
request, a tool call, a retry's wait) and for how long, so a slow model or a long tool call never
looks like a hang. Output that is not a terminal (a pipe, a file) gets no status line, no colour
codes and no hard wrapping: each line is written whole, however long.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from controller.events import (
    Event,
    Finished,
    ModelRetry,
    ModelText,
    Notice,
    Rejected,
    StepStarted,
    ToolCallEvent,
    ToolResultEvent,
    Usage,
)

TEXT_CHARS = 400  # of model text shown per step


def _short(text: str, limit: int = TEXT_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def make_console(stderr: bool = False) -> Console:
    """A console for people: at a terminal, rich's usual; otherwise no hard wrap (soft_wrap) and,
    as rich already does off a terminal, no colour codes."""
    probe = Console(stderr=stderr)
    return Console(stderr=stderr, highlight=False, soft_wrap=not probe.is_terminal)


class StatusLine:
    """What the run is waiting for, and since when: rendered afresh at each refresh of a ``Live``."""

    def __init__(self) -> None:
        self.step = 0
        self.what = ""
        self.since = time.monotonic()
        self.spinner = Spinner("dots", style="cyan")

    def set(self, what: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.what = what
        self.since = time.monotonic()

    def __rich__(self) -> RenderableType:
        if not self.what:
            return Text("")
        elapsed = time.monotonic() - self.since
        step = f"step {self.step} · " if self.step else ""
        line = Text.assemble((step, "bold"), self.what, (f"  {elapsed:.1f} s", "dim"))
        table = Table.grid(padding=(0, 1))
        table.add_row(self.spinner, line)
        return table


class Transcript:
    """Renders step events. ``live`` (default: when the console is a terminal and not ``json_lines``)
    adds the status line; call ``close()`` (or use it as a context manager) to remove it."""

    def __init__(self, json_lines: bool = False, console: Console | None = None, live: bool | None = None) -> None:
        self.json_lines = json_lines
        self.console = console or make_console()
        self.status = StatusLine()
        want_live = self.console.is_terminal and not json_lines if live is None else live
        self._live: Live | None = (
            Live(self.status, console=self.console, refresh_per_second=8, transient=True) if want_live else None
        )
        self._live_started = False

    def __enter__(self) -> Transcript:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._live is not None and self._live_started:
            self.status.set("")
            self._live.stop()
            self._live_started = False

    def set_status(self, what: str, step: int | None = None) -> None:
        self.status.set(what, step)
        if self._live is not None and not self._live_started and what:
            self._live.start()
            self._live_started = True

    def notice(self, text: str) -> None:
        self.show(Notice(text=text))

    def show(self, event: Event) -> None:
        if self.json_lines:
            sys.stdout.write(event.to_json() + "\n")
            sys.stdout.flush()
            return
        render = getattr(self, f"_{event.KIND}", None)
        if render is not None:
            render(event)

    def _notice(self, e: Notice) -> None:
        self.console.print(f"[dim]· {escape(e.text)}[/dim]")

    def _step(self, e: StepStarted) -> None:
        self.console.rule(f"[bold]step {e.step}[/bold]", style="dim", align="left")
        self.set_status("waiting for the model", e.step)

    def _model_retry(self, e: ModelRetry) -> None:
        self.console.print(
            f"  [yellow]model request failed, retry {e.attempt} in {e.delay_s:.1f} s[/yellow]: "
            f"[dim]{escape(_short(e.reason, 200))}[/dim]"
        )
        self.set_status(f"retry {e.attempt} of the model request (after: {_short(e.reason, 60)})")

    def _model_text(self, e: ModelText) -> None:
        self.set_status("working")
        if e.reasoning:
            self.console.print(f"[dim italic]thinking: {escape(_short(e.reasoning))}[/dim italic]")
        if e.text.strip():
            self.console.print(f"[cyan]model:[/cyan] {escape(_short(e.text))}")

    def _tool_call(self, e: ToolCallEvent) -> None:
        text = e.text or f"{e.tool}(...)"
        self.console.print(f"[bold yellow]→ {escape(_short(text, 200))}[/bold yellow]  [dim]sent to the executor[/dim]")
        self.set_status(f"running {_short(text, 60)} in the executor")

    def _tool_result(self, e: ToolResultEvent) -> None:
        where = []
        if e.worker_pid:
            where.append(f"worker pid {e.worker_pid}")
        if e.wall_s is not None:
            where.append(f"{e.wall_s * 1000:.1f} ms")
        if e.peak_rss_kb:
            where.append(f"{e.peak_rss_kb / 1024:.0f} MB peak")
        if e.worker_restarted:
            where.append("[red]worker replaced[/red]")
        tail = f"  [dim]({', '.join(where)})[/dim]" if where else ""
        self.set_status("working")
        if e.ok and e.value_is_repr:
            self.console.print(
                f"  [green]✓[/green] [yellow](not data: the repr() of the returned object)[/yellow] "
                f"{escape(e.summary)}{tail}"
            )
        elif e.ok:
            self.console.print(f"  [green]✓[/green] {escape(e.summary)}{tail}")
        else:
            self.console.print(f"  [red]✗ {escape(e.error_kind or 'error')}[/red]: "
                               f"{escape(_short(e.error_message or e.summary, 300))}{tail}")

    def _rejected(self, e: Rejected) -> None:
        self.console.print(f"  [magenta]✗ not run ({escape(e.code or 'rejected')})[/magenta]: "
                           f"{escape(_short(e.message, 300))}")

    def _usage(self, e: Usage) -> None:
        cost = f", ${e.total_cost:.4f}" if e.total_cost else ""
        self.console.print(f"  [dim]tokens {e.prompt_tokens}+{e.completion_tokens} "
                           f"(run: {e.total_prompt_tokens + e.total_completion_tokens}{cost})[/dim]")

    def _finished(self, e: Finished) -> None:
        self.close()
        colour = {"completed": "green", "stopped": "yellow"}.get(e.status, "red")
        self.console.rule(f"[bold {colour}]{e.status}[/bold {colour}]", style=colour)
        if e.summary:
            self.console.print(f"[bold]{escape(e.summary)}[/bold]")
        if e.reason:
            self.console.print(f"[dim]{escape(e.reason)}[/dim]")
        table = Table(show_header=False, box=None, pad_edge=False)
        rows: list[tuple[str, Any]] = [
            ("steps", e.steps), ("tool calls", e.calls), ("tool errors", e.tool_errors),
            ("worker restarts", e.worker_restarts), ("tokens", e.tokens), ("cost", f"${e.cost:.4f}"),
        ]
        for name, value in rows:
            table.add_row(f"[dim]{name}[/dim]", str(value))
        self.console.print(table)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, default=repr)
