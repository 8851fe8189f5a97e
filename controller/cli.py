"""``ciayn``: run an agent whose tools execute in an isolated executor; call or list tools directly."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from controller.models import OFFLINE_ENV

for _key, _value in OFFLINE_ENV.items():  # before anything can import litellm: no network but the model's
    os.environ.setdefault(_key, _value)

from controller.client import ExecutorClient, ExecutorUnavailable  # noqa: E402
from controller.local import ExecutorStartError, LocalExecutor  # noqa: E402
from protocol import CallRejected, Result, parse_call  # noqa: E402
from protocol.grammar import EXPECTED_SHAPE  # noqa: E402

BUILTIN_TOOLS = "executor.toolkits.builtin"
LOCAL_MODEL = "local"

DESCRIPTION = """\
ciayn-sandbox: an LLM agent whose tools never run inside the agent's process. Every tool call goes
as plain data over ZeroMQ to an executor that runs it in a supervised worker under resource limits.
"""

RUN_EPILOG = """\
examples:
  ciayn run "List the files and summarise README.md" --workspace ./project
        (the embedded local model, offline; install it once with scripts/setup-model)
  ciayn run "Fix the failing test" --model openai/gpt-4o-mini --workspace ./project
  ciayn run "..." --model openai/my-model --api-base http://127.0.0.1:8000/v1 --backend ciayn
  ciayn run "..." --model anthropic/claude-sonnet-4-20250514 --executor tcp://pool:5555
  ciayn run "Read notes.txt and report the code in it" --allow-tools read_file,complete_task
        (offer the model only the tools the task needs; the executor still holds the others)

Without --tools or --executor, a private executor serves the built-in toolkit (read_file,
write_file, list_dir, emit_note, complete_task; no shell) confined to --workspace.
Exit status: 0 when a tool signalled that the task is complete, 1 otherwise, 2 for usage errors,
130 when Ctrl-C stopped the run (the first Ctrl-C cancels what is in flight; a second exits at once).
"""


def _number(kind: type, *, minimum: float = 0.0, inclusive: bool = False) -> Any:
    """An argparse type: a finite number above ``minimum`` (or at it, when ``inclusive``)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = value >= minimum if inclusive else value > minimum
        if not ok or value != value or value in (float("inf"), float("-inf")):
            bound = f"at least {minimum:g}" if inclusive else f"more than {minimum:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


POSITIVE_FLOAT = _number(float)
POSITIVE_INT = _number(int)
NON_NEGATIVE_FLOAT = _number(float, inclusive=True)


class UserError(Exception):
    """Something the user can fix; printed as one paragraph, no traceback."""


# ------------------------------------------------------------------------------------------ parser


CONFIG_EPILOG = """\
settings: every option with a value can also come from an environment variable, CIAYN_ and the
option's name (CIAYN_MODEL, CIAYN_API_BASE, CIAYN_EXECUTOR, CIAYN_MAX_STEPS, ...; lists
comma-separated), or from a configuration file: the file named by CIAYN_CONFIG, else ./ciayn.toml,
else [tool.ciayn] in ./pyproject.toml (keys are option names: model = "openai/gpt-4o-mini").
Precedence: command line, then environment, then file, then the defaults shown here.
"""
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"  # as ciayn-executor's
# Libraries that log every request at info (httpx: each HTTP request; LiteLLM: each completion): their
# records show at debug only, so that info is ciayn's own lines.
CHATTY_LIBRARIES = ("httpx", "httpcore", "LiteLLM", "LiteLLM Router", "LiteLLM Proxy", "openai", "urllib3")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ciayn-sandbox")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _common_options(p: argparse.ArgumentParser, top: bool) -> None:
    """--log-level and -v, on the top parser and (so they may follow the command) on each command."""
    p.add_argument("--log-level", choices=LOG_LEVELS, metavar="LEVEL", default=None if top else argparse.SUPPRESS,
                   help="log verbosity on stderr, with timestamps: debug, info, warning, error (default: "
                   f"{DEFAULT_LOG_LEVEL}, as ciayn-executor's; the model libraries' own lines only at debug; "
                   "CIAYN_LOG_LEVEL); a private executor logs at this level too")
    p.add_argument("-v", "--verbose", action="count", default=0 if top else argparse.SUPPRESS,
                   help="more log output: -v is --log-level debug")


def _executor_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("executor (choose one; default: a private executor with the built-in toolkit)")
    g.add_argument("--executor", metavar="ENDPOINT", help="use a running executor or broker, e.g. tcp://host:5555")
    g.add_argument("--curve-server-key", metavar="FILE",
                   help="CurveZMQ: the executor's public key file (for a tcp executor started with --curve-secret)")
    g.add_argument("--curve-key", metavar="FILE",
                   help="CurveZMQ: this client's .key_secret file (for an executor started with --curve-clients)")
    g.add_argument("--tools", action="append", metavar="MODULE",
                   help="start a private executor with these tool modules (dotted name or .py path; repeatable)")
    p.add_argument("--workspace", metavar="DIR",
                   help="directory the private executor's file tools are confined to (default: .)")
    p.add_argument("--timeout", type=POSITIVE_FLOAT, metavar="S",
                   help="per-call wall-clock limit in seconds (default: the executor's, 30 s for a private one)")
    p.add_argument("--memory-mb", type=POSITIVE_INT, metavar="MB",
                   help="memory limit of a private executor's workers")
    p.add_argument("--pass-env", action="append", metavar="NAME",
                   help="hand this environment variable to a private executor's tools (repeatable); tools see "
                   "no other secrets")
    p.add_argument("--profile", choices=["default", "hardened"], metavar="PROFILE",
                   help="isolation of a private executor: default (a fresh worker process per call under "
                   "rlimits, killed with everything it started) or hardened (also: each call as nobody in its "
                   "own PID, mount and network namespaces, no network, a read-only filesystem, no capabilities, "
                   "seccomp, Landlock, cgroup limits; needs root). A hardened executor attacks each of its "
                   "layers first (its selfcheck, a few seconds) and the run does not start unless every one "
                   "holds. The profile for run_shell and CI: docs/ci.md (default: default)")
    p.add_argument("--workspace-rw", action="store_true",
                   help="with --profile hardened: tools may change the workspace, acting as its owner there "
                   "(without it the workspace is read-only to them). Each call's writes go to a private layer "
                   "(at most 1 GiB) and are copied into the workspace only after the call answered, before its "
                   "result is sent; a call that times out, crashes or is cancelled changes nothing")


def build_parser() -> argparse.ArgumentParser:
    """The ``ciayn`` command line: the top-level options and the run, call and tools commands."""
    parser = argparse.ArgumentParser(prog="ciayn", description=DESCRIPTION, epilog=CONFIG_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _common_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_parser(sub)
    _add_call_parser(sub)
    _add_tools_parser(sub)
    return parser


def _add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ciayn run TASK``: the model, the backend, the run's limits and prompt, and how it is shown."""
    run = sub.add_parser("run", help="run an agent on a task", description=DESCRIPTION,
                         epilog=RUN_EPILOG + "\n" + CONFIG_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("task", help="what the agent should do")
    run.add_argument("--model", metavar="MODEL",
                     help="litellm model string, e.g. openai/gpt-4o-mini; 'local' serves the embedded "
                     "SmolLM2-135M model on 127.0.0.1 (default: local)")
    run.add_argument("--api-base", metavar="URL", help="base URL of an OpenAI-compatible server for the model")
    run.add_argument("--backend", choices=["auto", "react", "ciayn"], metavar="BACKEND",
                     help="react: native tool calling (LangGraph); ciayn: one line of Python per step; "
                     "auto: react when the model is known to call tools well (default: auto)")
    run.add_argument("--max-steps", type=POSITIVE_INT, metavar="N", help="model requests before stopping (default: 30)")
    run.add_argument("--max-cost", type=POSITIVE_FLOAT, metavar="USD",
                     help="stop once this much is spent (only for models litellm has a price for; see "
                     "--max-tokens-total)")
    run.add_argument("--max-tokens-total", type=POSITIVE_INT, metavar="N",
                     help="stop once the run has used this many tokens (prompt and reply, all steps)")
    run.add_argument("--grammar", choices=["auto", "on", "off"], metavar="MODE",
                     help="constrain CIAYN replies with a GBNF grammar: on, off, or auto: on for the local model "
                     "(default: auto)")
    run.add_argument("--allow-tools", metavar="NAMES",
                     help="comma-separated tool names: offer the model only these (e.g. list_dir,read_file,"
                     "complete_task); calls to any other tool are refused without reaching the executor")
    run.add_argument("--prompt", choices=["auto", "full", "compact"], metavar="PROMPT",
                     help="CIAYN prompt: full rules and docstrings, or compact (short rules, one line per tool, "
                     "and demonstrated example turns) for small models, or auto: compact for the local model "
                     "(default: auto)")
    run.add_argument("--temperature", type=NON_NEGATIVE_FLOAT, metavar="T",
                     help="sampling temperature (default: 0, the most likely reply)")
    run.add_argument("--seed", type=int, metavar="N",
                     help="sampling seed, for servers that take one (llama.cpp, OpenAI)")
    run.add_argument("--max-tokens", type=POSITIVE_INT, metavar="N",
                     help="cap on each model reply's tokens (default: the provider's; 128 for the local model)")
    run.add_argument("--show-reasoning", action="store_true", help="show the model's reasoning / think blocks")
    run.add_argument("--json", action="store_true",
                     help="print one JSON event per line (each with an ISO 8601 UTC timestamp \"ts\") instead of "
                     "a transcript")
    _executor_options(run)
    _common_options(run, top=False)


def _add_call_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ciayn call TEXT``: one tool call, written as Python call text, run in the executor."""
    call = sub.add_parser("call", help="run one tool call, written as Python call text",
                          description="Parse one call (the CIAYN grammar: literal arguments only) and run it in "
                          "the executor. Ctrl-C cancels the call at the executor.",
                          epilog="example: ciayn call 'read_file(path=\"README.md\")'\n\n" + CONFIG_EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    call.add_argument("text", help="the call, e.g. 'list_dir(path=\".\")'")
    call.add_argument("--json", action="store_true", help="print the whole result as JSON")
    _executor_options(call)
    _common_options(call, top=False)


def _add_tools_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ciayn tools``: the executor's tools, with signatures and docs."""
    tools = sub.add_parser("tools", help="list the executor's tools",
                           description="List the tools an executor offers, with signatures and docs.",
                           epilog=CONFIG_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    tools.add_argument("--json", action="store_true", help="print the tool specs as JSON")
    _executor_options(tools)
    _common_options(tools, top=False)


# ------------------------------------------------------------------------------------------ executor


def _curve_options(args: argparse.Namespace) -> dict[str, Any]:
    if not args.curve_server_key:
        if args.curve_key:
            raise UserError("--curve-key needs --curve-server-key (the executor's public key file).")
        return {}
    from protocol.curve import CurveError, load_pair, load_public

    try:
        options: dict[str, Any] = {"curve_server_key": load_public(args.curve_server_key)}
        if args.curve_key:
            options["curve_keys"] = load_pair(args.curve_key)
    except CurveError as e:
        raise UserError(str(e)) from None
    return options


SOCKET_WAIT_S = 10.0  # an executor started a moment ago may not have bound its socket yet
EXECUTOR_WAIT_S = 10.0  # how long a running executor may take to answer the first time
FIRST_ANSWER_S = 1.0  # after this long without an answer, say that ciayn is waiting (and for how long)
PRIVATE_ONLY = (("workspace", "--workspace"), ("memory_mb", "--memory-mb"), ("pass_env", "--pass-env"),
                ("workspace_rw", "--workspace-rw"))

Say = Callable[[str], None]


def _say_on_stderr(text: str) -> None:
    print(f"ciayn: {text}", file=sys.stderr, flush=True)


def _appears(path: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def check_executor_args(args: argparse.Namespace, say: Say = _say_on_stderr) -> None:
    """Usage errors of the executor options, found before anything is started; options that would
    have no effect are named (``say``)."""
    if args.executor and args.tools:
        raise UserError("Give either --executor (a running executor) or --tools (start a private one), not both.")
    if args.workspace_rw and args.profile != "hardened":
        raise UserError("--workspace-rw is for --profile hardened, whose tools cannot write the workspace "
                        "without it (under the default profile they write it already, as your user).")
    if (args.curve_server_key or args.curve_key) and not args.executor:
        raise UserError("--curve-server-key and --curve-key are for --executor (a running executor over tcp).")
    if args.executor:
        sources = dict(getattr(args, "sources", {}))
        if args.workspace_rw:
            sources["workspace_rw"] = "command line"
        ignored = [flag for dest, flag in PRIVATE_ONLY if dest in sources]
        if ignored:
            say(f"Warning: {' and '.join(ignored)} configure a private executor and have no effect with --executor "
                f"{args.executor} (set from: {', '.join(sources[d] for d, f in PRIVATE_ONLY if f in ignored)}); "
                "the running executor keeps the workspace, limits and environment it was started with.")
    if args.executor and args.executor.startswith("ipc://"):
        path = args.executor[len("ipc://"):]
        if path and not path.startswith("@") and not os.path.exists(path):
            say(f"no executor socket at {path} yet; waiting up to {SOCKET_WAIT_S:g} s for it to appear")
            if not _appears(path, SOCKET_WAIT_S):
                raise UserError(f"No executor socket at {path}: start one with `ciayn-executor serve --bind "
                                f"{args.executor} --tools ...`, or check the path.")


@contextlib.contextmanager
def open_executor(args: argparse.Namespace, say: Say = _say_on_stderr) -> Iterator[ExecutorClient]:
    check_executor_args(args, say)
    if args.executor:
        try:
            client = ExecutorClient(args.executor, timeout=args.timeout, connect_timeout=EXECUTOR_WAIT_S,
                                    **_curve_options(args))
        except ValueError as e:
            raise UserError(f"{e}. Endpoints look like ipc:///path/to/socket or tcp://host:port.") from None
        try:
            try:
                client.tools(timeout=FIRST_ANSWER_S)
            except ExecutorUnavailable:
                rest = max(client.connect_timeout - FIRST_ANSWER_S, 0.1)
                say(f"no answer yet from the executor at {args.executor}; waiting up to {rest:g} s more")
                client.tools(timeout=rest)
        except ExecutorUnavailable as e:
            client.close()
            raise UserError(f"{e} Start one with `ciayn-executor serve --bind {args.executor} --tools ...`, or "
                            "check the endpoint (--executor, CIAYN_EXECUTOR).") from None
        served = client.welcome.profile if client.welcome is not None else "unknown"
        if args.profile == "hardened" and served != "hardened":
            client.close()
            raise UserError(f"--profile hardened: the executor at {args.executor} serves the {served!r} profile, "
                            "not hardened; start it with `ciayn-executor serve --profile hardened ...`, or leave "
                            "out --executor to start a hardened private one.")
        try:
            yield client
        finally:
            client.close()
        return
    workspace = Path(args.workspace)
    if not workspace.is_dir():
        raise UserError(f"The workspace {args.workspace!r} is not a directory. Create it or pass --workspace DIR.")
    limits: dict[str, Any] = {}
    if args.timeout:
        limits["timeout"] = args.timeout
    if args.memory_mb:
        limits["memory_mb"] = args.memory_mb
    if args.log_level:
        limits["log_level"] = args.log_level
    if args.profile == "hardened":
        limits.update(profile="hardened", workspace_rw=args.workspace_rw)
        say("starting a hardened private executor: its selfcheck attacks each isolation layer from a real "
            "worker first (a few seconds); the run starts only if every layer holds")
    local = LocalExecutor(tools=args.tools or [BUILTIN_TOOLS], workspace=workspace, pass_env=args.pass_env or (),
                          **limits)
    _LOCAL_PROCESSES.append(local)
    try:
        try:
            client = local.start()
        except ExecutorStartError as e:
            raise UserError(f"The private executor did not start: {e}") from None
        try:
            yield client
        finally:
            local.stop()
    finally:
        _LOCAL_PROCESSES.remove(local)


_LOCAL_PROCESSES: list[Any] = []  # what a second Ctrl-C kills before exiting at once (kill())


def _abort_now() -> None:
    """The second Ctrl-C: kill what this process started, without waiting, and exit 130."""
    for process in list(_LOCAL_PROCESSES):
        with contextlib.suppress(Exception):
            process.kill()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.write("\nciayn: aborted\n")
        sys.stderr.flush()
    os._exit(130)


@contextlib.contextmanager
def interruptible(on_first: Callable[[], None]) -> Iterator[None]:
    """Within the block, the first Ctrl-C (SIGINT) calls ``on_first`` (which asks the work to stop)
    and the second exits at once (``_abort_now``)."""
    count = 0

    def handler(signum: int, frame: Any) -> None:
        nonlocal count
        count += 1
        if count > 1:
            _abort_now()
        on_first()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# ------------------------------------------------------------------------------------------ commands


def cmd_tools(args: argparse.Namespace) -> int:
    with open_executor(args) as client:
        specs = client.tools()
        if args.json:
            print(json.dumps([s.model_dump() for s in specs], indent=2))
            return 0
        from controller.render import make_console

        console = make_console()
        for spec in specs:
            flags = [f for f in ("bundleable", "no_repeat", "idempotent") if getattr(spec, f)]
            tail = f"  [dim]({', '.join(flags)})[/dim]" if flags else ""
            console.print(f"[bold cyan]{spec.name}[/bold cyan]{_esc(spec.signature)}{tail}")
            for line in (spec.doc or "(no docstring)").splitlines():
                console.print(f"    {_esc(line)}", highlight=False)
            console.print()
    return 0


def cmd_call(args: argparse.Namespace) -> int:
    import threading

    from controller.run import call_until_stopped

    stopping = threading.Event()
    with open_executor(args) as client:
        specs = {s.name: s for s in client.tools()}
        try:
            call = parse_call(args.text, specs)
        except CallRejected as e:
            kind = e.code if e.code in ("unknown_tool", "bad_arguments") else "rejected"
            result = Result.failure("", kind, str(e))  # type: ignore[arg-type]
        else:
            call = call.model_copy(update={"id": uuid.uuid4().hex})

            def cancel() -> None:
                _say_on_stderr(f"Ctrl-C: cancelling {args.text} (call {call.id}) at the executor "
                               "(Ctrl-C again to exit at once)")
                stopping.set()

            from controller.render import Transcript, make_console

            with interruptible(cancel), Transcript(console=make_console(stderr=True)) as status:
                status.set_status(f"running {args.text} in the executor")  # at a terminal: a status line
                result = call_until_stopped(client, call, args.timeout, stopping)
    if args.json:
        print(result.model_dump_json(indent=2))
    else:
        _print_result(result)
    if stopping.is_set():
        return 130
    return 0 if result.ok else 1


def _print_result(result: Result) -> None:
    from controller.render import make_console

    err = make_console(stderr=True)  # off a terminal: no hard wrap at 80 columns
    if result.stdout:
        err.print("[dim]stdout:[/dim]", _esc(result.stdout.rstrip()), highlight=False)
    if result.stderr:
        err.print("[dim]stderr:[/dim]", _esc(result.stderr.rstrip()), highlight=False)
    if result.ok:
        value = result.value
        if isinstance(value, str):
            print(value)
        else:
            print(json.dumps(value, indent=2, ensure_ascii=False, default=repr))
    else:
        assert result.error is not None
        message = result.error.message.replace(EXPECTED_SHAPE, "").strip()  # that hint is for models
        err.print(f"[bold red]{result.error.kind}[/bold red]: {_esc(message)}", highlight=False)
        if result.error.traceback:
            err.print(_esc(result.error.traceback.rstrip()), style="dim", highlight=False)
    for s in result.signals:
        err.print(f"[green]signal {s.kind}[/green]: {_esc(s.message)}", highlight=False)
    if result.worker and result.stats:
        err.print(_worker_line(result), style="dim", highlight=False)


def _worker_line(result: Result) -> str:
    w, s = result.worker, result.stats
    assert w is not None and s is not None
    restarted = ", worker restarted" if w.restarted else ""
    return f"worker {w.id} pid {w.pid}: {s.wall_s * 1000:.1f} ms, {s.peak_rss_kb / 1024:.0f} MB peak{restarted}"


def _esc(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def cmd_run(args: argparse.Namespace) -> int:
    from controller.models import ModelConfig, check_endpoint, price_known
    from controller.render import Transcript

    with contextlib.ExitStack() as stack:
        transcript = stack.enter_context(Transcript(json_lines=args.json))
        model, api_base, grammar, backend = args.model, args.api_base, args.grammar, args.backend
        prompt, max_tokens = args.prompt, args.max_tokens
        if model == LOCAL_MODEL:
            from controller.local_model import LocalModelServer, LocalSettings, ModelNotInstalled, ModelServerError

            transcript.notice("starting the embedded model (SmolLM2-135M-Instruct) on 127.0.0.1 ...")
            server_holder = LocalModelServer()
            _LOCAL_PROCESSES.append(server_holder)
            stack.callback(_LOCAL_PROCESSES.remove, server_holder)
            try:
                server = stack.enter_context(server_holder)
            except (ModelNotInstalled, ModelServerError) as e:
                raise UserError(str(e)) from None
            local = LocalSettings.from_options(grammar, prompt, max_tokens)  # what create_agent("local") uses
            model, api_base = local.agent_settings(server, backend)["model"], server.api_base
            grammar, prompt, max_tokens = "on" if local.grammar else "off", local.prompt, local.max_tokens
        else:
            # Before the executor starts: a wrong URL, a server that is down or a missing key is
            # reported in one paragraph now, not after retries in the first step.
            transcript.notice(f"checking the model {model} at {api_base or 'its provider'} (loading litellm "
                              "takes a few seconds) ...")
            problem = check_endpoint(ModelConfig(model=model, api_base=api_base))
            if problem is not None:
                raise UserError(problem)
        if args.max_cost is not None and not price_known(model):
            transcript.notice(
                f"Warning: --max-cost cannot be enforced: litellm has no price for {model}, so every reply counts "
                "as $0. Bound the run with --max-tokens-total N (tokens, counted for every model) instead."
            )
        if not args.executor and args.profile != "hardened":  # (a hardened one says so itself)
            transcript.notice("starting a private executor ...")
        client = stack.enter_context(open_executor(args, transcript.notice))
        tools = client.tools()
        transcript.notice(f"executor ready: {len(tools)} tools ({', '.join(t.name for t in tools)}); "
                          f"every call runs in a supervised worker process")
        allow_tools = _allowed_tools(args.allow_tools, client)
        if allow_tools is not None:
            transcript.notice(f"tools offered to the model: {', '.join(allow_tools)}")
        config = ModelSettings(model=model, api_base=api_base, grammar=grammar == "on", prompt=prompt,
                               max_tokens=max_tokens, allow_tools=allow_tools)
        agent = _make_agent(config, backend, args, client)
        ignored = [f"--{d}" for d in ("grammar", "prompt") if d in getattr(args, "sources", {})]
        if agent.backend == "react" and ignored:
            transcript.notice(f"Warning: {' and '.join(ignored)} shape CIAYN replies and have no effect on the "
                              "react backend (native tool calls); pass --backend ciayn to use them.")
        finished, interrupted = _drive(agent, args.task, transcript)
    if interrupted:
        return 130
    return 0 if finished is not None and finished.status == "completed" else 1


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """What ``cmd_run`` resolved from the options and the model ('local' fills in its defaults)."""

    model: str
    api_base: str | None
    grammar: bool
    prompt: str  # auto, full or compact
    max_tokens: int | None
    allow_tools: list[str] | None


def _allowed_tools(text: str | None, client: ExecutorClient) -> list[str] | None:
    """The --allow-tools names, checked against the executor's tools (a user error if any is missing)."""
    if text is None:
        return None
    from controller.allowlist import AllowedTools, UnknownTools, parse_names

    names = parse_names(text)
    if not names:
        raise UserError("--allow-tools names no tools; give comma-separated names, e.g. read_file,complete_task.")
    try:
        AllowedTools(client, names).tools()
    except UnknownTools as e:
        raise UserError(f"--allow-tools: {e}.") from None
    return names


def _make_agent(settings: ModelSettings, backend: str, args: argparse.Namespace, client: ExecutorClient) -> Any:
    from controller.agent import create_agent
    from controller.models import ModelConfig

    config = ModelConfig(
        model=settings.model,
        api_base=settings.api_base,
        use_grammar=settings.grammar,
        max_tokens=settings.max_tokens,
        extras={"seed": args.seed} if args.seed is not None else {},
        **({"temperature": args.temperature} if args.temperature is not None else {}),
    )
    from controller.ciayn import prompt_options

    options: dict[str, Any] = prompt_options(settings.prompt)  # CIAYN's; ReAct ignores them
    if settings.allow_tools is not None:
        options["allow_tools"] = settings.allow_tools
    return create_agent(config, client, backend=backend, max_steps=args.max_steps, max_cost=args.max_cost,
                        max_tokens_total=args.max_tokens_total, show_reasoning=args.show_reasoning,
                        call_timeout=args.timeout, **options)


def _drive(agent: Any, task: str, transcript: Any) -> tuple[Any, bool]:
    """Stream the run: ``(its Finished event, whether Ctrl-C stopped it)``. The first Ctrl-C stops
    the agent (the model request in flight is abandoned, the tool call in flight is cancelled at the
    executor, the run ends ``stopped``); the second exits at once."""
    interrupted = False

    def stop() -> None:
        nonlocal interrupted
        interrupted = True
        transcript.notice("Ctrl-C: stopping; cancelling what is in flight (Ctrl-C again to exit at once)")
        agent.stop("interrupted by the user (Ctrl-C)")

    finished = None
    with interruptible(stop):
        for event in agent.stream(task):
            transcript.show(event)
            if type(event).__name__ == "Finished":
                finished = event
    return finished, interrupted


def _setup_logging(args: argparse.Namespace) -> None:
    """Log records on stderr with timestamps; the level from --log-level, -v or CIAYN_LOG_LEVEL."""
    level = args.log_level or os.environ.get("CIAYN_LOG_LEVEL", "").lower() or None
    if level is not None and level not in LOG_LEVELS:
        raise UserError(f"CIAYN_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    if level is None and args.verbose:
        level = "debug"
    args.log_level = level
    logging.basicConfig(stream=sys.stderr, level=(level or DEFAULT_LOG_LEVEL).upper(),
                        format="%(asctime)s ciayn[%(process)d] %(levelname)s %(name)s: %(message)s")
    if level != "debug":
        for name in CHATTY_LIBRARIES:
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[command]
            return found
    raise KeyError(command)


def main(argv: list[str] | None = None) -> int:
    from controller.config import ConfigError, apply, read_layers

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # after a command, that command's usage (`ciayn run x --bogus`), not the top level's
        _command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    handlers = {"run": cmd_run, "call": cmd_call, "tools": cmd_tools}
    try:
        _setup_logging(args)
        try:
            args.sources = apply(args, _command_parser(parser, args.command), read_layers())
        except ConfigError as e:
            raise UserError(str(e)) from None
        return handlers[args.command](args)
    except UserError as e:
        print(f"ciayn: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ciayn: aborted", file=sys.stderr)
        return 130
    except Exception as e:  # a model provider's error, say: one paragraph, not a traceback
        from controller.models import ModelError

        if isinstance(e, ModelError):
            print(f"ciayn: the model request failed: {e}", file=sys.stderr)
            return 1
        raise


def run() -> None:
    """The ``ciayn`` command: ``main``, then an exit without the interpreter's teardown. Once litellm
    is loaded, tearing its modules down costs 0.7 s of CPU here (2 s after a run's requests, 6-11 s
    on a loaded CI machine), after the command has said all it had to say; what the command started
    (the executor, the model server, their directories) ``main`` has stopped by then."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (a closed pipe: nothing more can be said there)
            stream.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    run()
