"""The run transcript: step events rendered for a person (rich), or as JSON lines for programs."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from controller.events import (
    Event,
    Finished,
    ModelText,
    Notice,
    Rejected,
    ToolCallEvent,
    ToolResultEvent,
    Usage,
)

TEXT_CHARS = 400  # of model text shown per step


def _short(text: str, limit: int = TEXT_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Transcript:
    def __init__(self, json_lines: bool = False, console: Console | None = None) -> None:
        self.json_lines = json_lines
        self.console = console or Console(highlight=False)

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

    def _model_text(self, e: ModelText) -> None:
        self.console.rule(f"[bold]step {e.step}[/bold]", style="dim", align="left")
        if e.reasoning:
            self.console.print(f"[dim italic]thinking: {escape(_short(e.reasoning))}[/dim italic]")
        if e.text.strip():
            self.console.print(f"[cyan]model:[/cyan] {escape(_short(e.text))}")

    def _tool_call(self, e: ToolCallEvent) -> None:
        text = e.text or f"{e.tool}(...)"
        self.console.print(f"[bold yellow]→ {escape(_short(text, 200))}[/bold yellow]  [dim]sent to the executor[/dim]")

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
        if e.ok:
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
