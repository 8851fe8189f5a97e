"""``ciayn`` as a person uses it: Ctrl-C, signs of life, clear errors, settings, output off a terminal.

The Ctrl-C tests run ``ciayn`` as a real process against a real executor and send it real SIGINTs;
the model is the scripted OpenAI-compatible stub server (tests/llm_stub.py) over real HTTP.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CIAYN_TOOLS, log_lines
from llm_stub import LLMStub
from rich.console import Console

from controller import LocalExecutor, cli
from controller.config import SETTINGS, ConfigError, apply, read_layers
from controller.events import Finished, ModelRetry, Notice, StepStarted, ToolCallEvent
from controller.local import DIR_PREFIX, sweep_stale_dirs
from controller.render import Transcript
from tests.support.net import free_port

ROOT = Path(__file__).parent.parent
DONE = 'complete_task(summary="all done")'


# How long a ``ciayn`` child may take to get going (Python, litellm's import, a private executor, the
# first model request): seconds when the machine is idle, much longer beside a parallel test suite.
START_S = 60
# How long a whole ``ciayn`` run may take to exit: START_S, the run, and the interpreter's exit after
# litellm (seconds of finalising its modules, no system call; 6-11 s on a loaded 2-core machine, where
# whole runs took 35-50 s and one on CI passed 60 s after printing its summary).
RUN_S = 110
TWO_RUNS_S = 2 * RUN_S + 30  # pytest's own timeout (120 s) for a test that runs ciayn twice in turn


def wait_for(condition: Callable[[], bool], within: float, what: str, c: Ciayn | None = None) -> None:
    """Poll ``condition`` until it holds; fail after ``within`` seconds, or at once if ``c`` exited,
    showing what ``c`` printed."""
    deadline = time.monotonic() + within
    while not condition():
        exited = c is not None and c.proc.poll() is not None
        if exited or time.monotonic() > deadline:
            if condition():
                return
            why = f"ciayn exited {c.proc.returncode} before" if exited and c is not None else f"not within {within} s"
            shown = f"\nstdout:\n{c.out[-3000:]}\nstderr:\n{c.err[-3000:]}" if c is not None else ""
            raise AssertionError(f"{why}: {what}{shown}")
        time.sleep(0.05)


class Ciayn:
    """``python -m controller.cli ...`` as a child process whose output is collected as it comes."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        env.pop("OPENAI_API_KEY", None)
        n = len(list(cwd.glob("ciayn*.out")))  # files of their own: a test may start several in turn
        self.out_path = cwd / f"ciayn{n}.out"
        self.err_path = cwd / f"ciayn{n}.err"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controller.cli", *argv],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.out_path.open("wb"),
            stderr=self.err_path.open("wb"),
        )

    @property
    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def wait(self, within: float) -> int:
        try:
            return self.proc.wait(within)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            output = f"stdout:\n{self.out}\nstderr:\n{self.err}"
            raise AssertionError(f"ciayn did not exit within {within} s\n{output}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def ciayn(tmp_path: Path) -> Iterator[Callable[..., Ciayn]]:
    started: list[Ciayn] = []

    def start(*argv: str) -> Ciayn:
        c = Ciayn(list(argv), tmp_path)
        started.append(c)
        return c

    yield start
    for c in started:
        c.close()


def run_argv(api_base: str, workspace: Path, *more: str) -> list[str]:
    model = ["--model", "openai/stub", "--api-base", api_base, "--backend", "ciayn"]
    return ["run", "do the task", *model, "--tools", CIAYN_TOOLS, "--workspace", str(workspace), *more]


# --- Ctrl-C ---------------------------------------------------------------------------------------


def test_first_ctrl_c_cancels_the_running_call_at_the_executor_and_ends_stopped(
    ciayn: Callable[..., Ciayn], workspace: Path
) -> None:
    with LLMStub(["slow(seconds=60)", DONE]) as stub:
        c = ciayn(*run_argv(stub.api_base, workspace, "--json"))
        wait_for(lambda: "slow started" in log_lines(workspace), START_S, "the slow call started in a worker", c)
        started = time.monotonic()
        c.interrupt()
        code = c.wait(15)
        took = time.monotonic() - started
    events = [json.loads(line) for line in c.out.splitlines() if line.startswith("{")]
    assert code == 130, c.err
    assert took < 10  # not the 60 s the tool would take
    [result] = [e for e in events if e["event"] == "tool_result"]
    assert (result["tool"], result["error_kind"]) == ("slow", "cancelled")  # the executor's answer
    assert any(e["event"] == "notice" and e["text"].startswith("Cancelled slow(seconds=60)") for e in events)
    assert events[-1]["event"] == "finished" and events[-1]["status"] == "stopped"
    assert "Ctrl-C" in events[-1]["reason"]
    assert "slow finished" not in log_lines(workspace)  # the worker was killed, not left to finish
    assert len(stub.requests) == 1  # no further model request


def test_first_ctrl_c_abandons_a_slow_model_request(ciayn: Callable[..., Ciayn], workspace: Path) -> None:
    def slow_model(body: dict[str, Any]) -> str:
        time.sleep(30)
        return DONE

    with LLMStub([slow_model]) as stub:
        c = ciayn(*run_argv(stub.api_base, workspace))
        wait_for(lambda: len(stub.requests) == 1, START_S, "the model request was sent", c)
        started = time.monotonic()
        c.interrupt()
        code = c.wait(15)
        took = time.monotonic() - started
    assert code == 130, c.err
    assert took < 10
    assert "Abandoned the model request of step 1" in c.out and "stopped" in c.out
    assert "step 1" in c.out  # the step header came before the reply


def test_second_ctrl_c_exits_at_once_when_the_executor_does_not_answer(
    ciayn: Callable[..., Ciayn], make_client: Callable[..., Any], workspace: Path
) -> None:
    client = make_client(tools=[CIAYN_TOOLS], workspace=workspace)
    local: LocalExecutor = client.local
    assert local.proc is not None
    with LLMStub(["slow(seconds=60)", DONE]) as stub:
        argv = ["run", "do the task", "--model", "openai/stub", "--api-base", stub.api_base, "--backend", "ciayn",
                "--executor", local.endpoint]
        c = ciayn(*argv)
        wait_for(lambda: "slow started" in log_lines(workspace), START_S, "the slow call started", c)
        os.kill(local.proc.pid, signal.SIGSTOP)  # the executor can no longer confirm a cancel
        try:
            c.interrupt()
            wait_for(lambda: "Ctrl-C: stopping" in c.out, 10, "the first Ctrl-C was acknowledged", c)
            started = time.monotonic()
            c.interrupt()
            code = c.wait(10)
            took = time.monotonic() - started
        finally:
            os.kill(local.proc.pid, signal.SIGCONT)
    assert code == 130 and "aborted" in c.err
    assert took < 3


def test_ciayn_call_ctrl_c_cancels_the_call(ciayn: Callable[..., Ciayn], workspace: Path) -> None:
    c = ciayn("call", "slow(seconds=60)", "--tools", CIAYN_TOOLS, "--workspace", str(workspace))
    wait_for(lambda: "slow started" in log_lines(workspace), START_S, "the call started", c)
    c.interrupt()
    assert c.wait(15) == 130
    assert "cancelling slow(seconds=60)" in c.err and "cancelled" in c.err
    assert "slow finished" not in log_lines(workspace)


# --- model endpoint and executor checks -----------------------------------------------------------


def test_an_unreachable_model_server_is_reported_first_with_its_url(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    code = cli.main(run_argv("http://127.0.0.1:9/v1", workspace))
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2 and took < 5
    assert "The model server at http://127.0.0.1:9/v1 cannot be reached" in err
    assert "--api-base" in err and "executor ready" not in err


def test_a_missing_api_key_is_named_before_anything_starts(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    argv = ["run", "x", "--model", "openai/gpt-4o-mini", "--workspace", str(workspace)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "needs OPENAI_API_KEY" in err and "HTTP 500" not in err


def test_a_refused_connection_mid_run_names_the_url_quickly() -> None:
    from controller.models import ModelConfig, ModelError, complete

    config = ModelConfig(model="openai/stub", api_base="http://127.0.0.1:9/v1", retry_base_s=0.01)
    # Mid-run, litellm is loaded and has made a request: its import and the first request's lazy
    # loading (seconds each on a loaded machine) are not what "quickly" is about.
    with pytest.raises(ModelError):
        complete(config, [{"role": "user", "content": "hi"}])
    started = time.monotonic()
    with pytest.raises(ModelError) as caught:
        complete(config, [{"role": "user", "content": "hi"}])
    assert time.monotonic() - started < 5
    text = str(caught.value)
    assert "http://127.0.0.1:9/v1" in text and "Could not connect" in text and "HTTP 500" not in text


def test_retries_are_reported_as_events(make_client: Callable[..., Any], workspace: Path) -> None:
    from llm_stub import StubError

    from controller.ciayn import CiaynAgent
    from controller.models import LiteLLMModel, ModelConfig

    client = make_client(tools=[CIAYN_TOOLS], workspace=workspace)  # its tools log their calls there
    with LLMStub([StubError(503, "busy"), DONE]) as stub:
        config = ModelConfig(model="openai/stub", api_base=stub.api_base, retry_base_s=0.01)
        events = list(CiaynAgent(LiteLLMModel(config), client).stream("x"))
    [retry] = [e for e in events if isinstance(e, ModelRetry)]
    assert retry.step == 1 and retry.attempt == 1 and "busy" in retry.reason
    assert isinstance(events[-1], Finished) and events[-1].status == "completed"


def test_options_without_effect_on_a_running_executor_are_named(
    make_client: Callable[..., Any], workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = make_client(tools=[CIAYN_TOOLS], workspace=workspace)
    argv = ["call", "same()", "--executor", client.local.endpoint, "--workspace", str(workspace)]
    argv += ["--memory-mb", "50"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "--workspace and --memory-mb configure a private executor and have no effect with --executor" in err


def test_waiting_for_a_missing_ipc_socket_says_so_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "SOCKET_WAIT_S", 0.3)
    assert cli.main(["tools", "--executor", f"ipc://{tmp_path}/typo.sock"]) == 2
    err = capsys.readouterr().err
    assert f"no executor socket at {tmp_path}/typo.sock yet; waiting up to 0.3 s" in err
    assert "No executor socket at" in err


def test_max_cost_without_a_price_warns_and_a_token_budget_stops_the_run(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with LLMStub(["same()", "tick()", "same()", DONE]) as stub:
        code = cli.main(run_argv(stub.api_base, workspace, "--max-cost", "0.01", "--max-tokens-total", "1", "--json"))
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 1
    warning = "--max-cost cannot be enforced: litellm has no price for openai/stub"
    assert any(warning in e.get("text", "") for e in events)
    assert events[-1]["status"] == "stopped" and "token limit (1)" in events[-1]["reason"]
    assert events[-1]["steps"] == 1


# --- conventions: version, logs, settings, output --------------------------------------------------


def test_version_and_log_level(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("ciayn ")
    parser = cli.build_parser()
    assert parser.parse_args(["tools", "-vv"]).verbose == 2
    assert parser.parse_args(["--log-level", "debug", "tools"]).log_level == "debug"


def _options_taking_a_value(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    for command, sub in [("", parser), *next(a for a in parser._actions
                                            if isinstance(a, argparse._SubParsersAction)).choices.items()]:
        for action in sub._actions:
            if action.option_strings and action.help != argparse.SUPPRESS and action.nargs != 0 and not isinstance(
                    action, argparse._HelpAction | argparse._VersionAction | argparse._CountAction):
                yield f"{parser.prog} {command} {action.option_strings[0]}", action


def test_both_commands_write_defaults_and_metavars_one_way() -> None:
    """Every option that takes a value names it (N, S, MB, FILE, LEVEL, ...: never argparse's DEST or
    {a,b}) and states its default as "(default: X)"; both log at info by default, and -v is debug."""
    from executor import cli as executor_cli

    for parser, defaults in ((cli.build_parser(), SETTINGS), (executor_cli.build_parser(), None)):
        for name, action in _options_taking_a_value(parser):
            assert action.metavar is not None, f"{name}: no metavar"
            default = action.default if defaults is None else defaults.get(action.dest)
            if default not in (None, False, [], argparse.SUPPRESS):
                assert "(default: " in (action.help or ""), f"{name}: its default {default!r} is not stated"
    for parser in (cli.build_parser(), executor_cli.build_parser()):
        helps = {name.split()[-1]: a.help or "" for name, a in _options_taking_a_value(parser)}
        assert "(default: info" in helps["--log-level"], helps["--log-level"]
    assert executor_cli.build_parser().parse_args(["serve", "--tools", "x", "--bind", "ipc:///x", "-v"]).verbose == 1


@pytest.mark.timeout(TWO_RUNS_S)
def test_the_default_log_level_is_info_without_the_model_libraries_lines(
    ciayn: Callable[..., Ciayn], workspace: Path
) -> None:
    with LLMStub([DONE, DONE]) as stub:
        quiet = ciayn(*run_argv(stub.api_base, workspace))
        assert quiet.wait(RUN_S) == 0, quiet.err
        loud = ciayn(*run_argv(stub.api_base, workspace, "-v"))
        assert loud.wait(RUN_S) == 0, loud.err
    assert "httpx" not in quiet.err and "LiteLLM" not in quiet.err, quiet.err  # they log each request at info
    assert " DEBUG " in loud.err and "httpx" in loud.err, loud.err[-2000:]


def test_an_unknown_option_after_a_command_gets_that_commands_usage() -> None:
    for argv, usage in ((["run", "x", "--bogus"], "usage: ciayn run "), (["tools", "--bogus"], "usage: ciayn tools ")):
        out = subprocess.run([sys.executable, "-m", "controller.cli", *argv], capture_output=True, text=True,
                             timeout=START_S, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 2 and out.stderr.startswith(usage), out.stderr
        assert "unrecognized arguments: --bogus" in out.stderr
    out = subprocess.run([sys.executable, "-m", "executor.cli", "serve", "--tools", "x", "--bind", "ipc:///x",
                          "--bogus"], capture_output=True, text=True, timeout=START_S, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.startswith("usage: ciayn-executor serve "), out.stderr
    version = subprocess.run([sys.executable, "-m", "executor.cli", "--version"], capture_output=True, text=True,
                             timeout=START_S, cwd=ROOT)
    assert version.returncode == 0 and version.stdout.startswith("ciayn-executor "), version


def test_settings_come_from_the_command_line_then_environment_then_file(tmp_path: Path) -> None:
    (tmp_path / "ciayn.toml").write_text('model = "openai/from-file"\nmax-steps = 7\napi_base = "http://file/v1"\n')
    parser = cli.build_parser()
    run = cli._command_parser(parser, "run")
    env = {"CIAYN_MAX_STEPS": "9", "CIAYN_TOOLS": "a.py,b.py"}
    args = parser.parse_args(["run", "task", "--api-base", "http://cli/v1"])
    sources = apply(args, run, read_layers(env, tmp_path))
    assert (args.model, args.max_steps, args.api_base) == ("openai/from-file", 9, "http://cli/v1")
    assert args.tools == ["a.py", "b.py"]
    assert sources["model"].endswith("ciayn.toml") and sources["max_steps"] == "CIAYN_MAX_STEPS"
    assert sources["api_base"] == "command line" and args.backend == "auto" and "backend" not in sources

    (tmp_path / "ciayn.toml").unlink()
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.ciayn]\nbackend = "react"\n')
    args = parser.parse_args(["run", "task"])
    apply(args, run, read_layers({}, tmp_path))
    assert args.backend == "react"

    with pytest.raises(ConfigError, match="CIAYN_MAX_STEPS: must be a finite number"):
        apply(parser.parse_args(["run", "t"]), run, read_layers({"CIAYN_MAX_STEPS": "0"}, tmp_path))
    (tmp_path / "pyproject.toml").write_text('[tool.ciayn]\nmodle = "x"\n')
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) modle"):
        read_layers({}, tmp_path)


def test_each_stage_before_the_first_step_says_what_it_is_doing(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hosted model's check (litellm's import: seconds) and the private executor's start each say
    so before they begin; before, nothing came before "executor ready", a blank screen."""
    with LLMStub([DONE]) as stub:
        api_base = stub.api_base
        assert cli.main(run_argv(api_base, workspace, "--json")) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    before = [e["text"] for e in events[: next(i for i, e in enumerate(events) if e["event"] == "step")]]
    assert before[0] == f"checking the model openai/stub at {api_base} (loading litellm takes a few seconds) ..."
    assert before[1] == "starting a private executor ..." and before[2].startswith("executor ready: "), before


def test_environment_settings_reach_a_real_run(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with LLMStub([DONE]) as stub:
        monkeypatch.setenv("CIAYN_MODEL", "openai/stub")
        monkeypatch.setenv("CIAYN_API_BASE", stub.api_base)
        monkeypatch.setenv("CIAYN_BACKEND", "ciayn")
        monkeypatch.setenv("CIAYN_TOOLS", CIAYN_TOOLS)
        monkeypatch.setenv("CIAYN_WORKSPACE", str(workspace))
        assert cli.main(["run", "do the task"]) == 0
        assert len(stub.requests) == 1
    assert log_lines(workspace) == ["complete all done"]


@pytest.mark.timeout(TWO_RUNS_S)
def test_output_off_a_terminal_has_timestamps_no_colour_codes_and_no_hard_wrap(
    ciayn: Callable[..., Ciayn], workspace: Path
) -> None:
    long_line = "append_line(text='" + "x" * 150 + "')"
    with LLMStub([long_line, DONE]) as stub:
        c = ciayn(*run_argv(stub.api_base, workspace))
        assert c.wait(RUN_S) == 0, c.err
        j = ciayn(*run_argv(stub.api_base, workspace, "--json"))
        stub.add(long_line, DONE)
        assert j.wait(RUN_S) == 0, j.err
    assert "\x1b[" not in c.out
    assert any(long_line in line for line in c.out.splitlines())  # one line, not wrapped at 80 columns
    events = [json.loads(line) for line in j.out.splitlines()]
    assert all(e["ts"].endswith("Z") and e["ts"][:4].isdigit() for e in events)
    assert [e["event"] for e in events if e["event"] in ("step", "finished")] == ["step", "step", "finished"]


@pytest.mark.timeout(TWO_RUNS_S)
def test_ciayn_call_off_a_terminal_writes_long_lines_whole(ciayn: Callable[..., Ciayn], workspace: Path) -> None:
    long_text = "w" * 150
    base = ["--tools", CIAYN_TOOLS, "--workspace", str(workspace)]
    told = ciayn("call", f"tell(text='{long_text}')", *base)  # stdout and stderr are files, not a terminal
    assert told.wait(RUN_S) == 0, told.err
    failed = ciayn("call", f"fail(message='{long_text}')", *base)
    assert failed.wait(RUN_S) == 1, failed.err
    assert told.out.splitlines() == ["told"]
    assert any(f"signal note: {long_text}" in line for line in told.err.splitlines()), told.err
    assert any(line.startswith("tool_error") and long_text in line for line in failed.err.splitlines()), failed.err
    assert "\x1b[" not in told.err + failed.err


def test_the_status_line_shows_the_step_what_is_in_flight_and_for_how_long() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=100)
    transcript = Transcript(console=console, live=False)
    transcript.show(StepStarted(step=3))
    console.print(transcript.status)
    assert "step 3 · waiting for the model" in out.getvalue()
    transcript.show(ToolCallEvent(step=3, call_id="c", tool="slow", text="slow(seconds=60)"))
    console.print(transcript.status)
    text = out.getvalue()
    assert "running slow(seconds=60) in the executor" in text and " s" in text.splitlines()[-1]
    transcript.show(ModelRetry(step=3, attempt=2, delay_s=1.5, reason="HTTP 503"))
    assert "retry 2 in 1.5 s" in out.getvalue()
    transcript.show(Notice("bye"))


# --- leftovers of a killed controller --------------------------------------------------------------


def test_a_sigkilled_controller_leaves_no_executor_directory_behind(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from controller import LocalExecutor\n"
        f"local = LocalExecutor(tools=[{CIAYN_TOOLS!r}])\n"
        "local.start()\n"
        "print(local.dir, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        left = Path(proc.stdout.readline().strip())
        assert left.name.startswith(f"{DIR_PREFIX}{proc.pid}-") and (left / "executor.log").exists()
    finally:
        proc.kill()
        proc.wait()
    assert left.exists()  # SIGKILL gave it no chance to clean up
    with LocalExecutor(tools=[CIAYN_TOOLS]):  # the next start sweeps it
        assert not left.exists()
    mine = tmp_path / f"{DIR_PREFIX}{os.getpid()}-alive"
    mine.mkdir()
    assert sweep_stale_dirs(str(tmp_path)) == [] and mine.exists()  # a live controller's dir is kept


def test_waiting_for_a_silent_tcp_endpoint_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()  # a port nothing listens on
    monkeypatch.setattr(cli, "FIRST_ANSWER_S", 0.2)
    monkeypatch.setattr(cli, "EXECUTOR_WAIT_S", 0.6)
    assert cli.main(["tools", "--executor", f"tcp://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"no answer yet from the executor at tcp://127.0.0.1:{port}; waiting up to 0.4 s more" in err
    assert f"ciayn-executor serve --bind tcp://127.0.0.1:{port}" in err


def test_pass_env_hands_a_variable_to_the_tools_of_a_private_executor(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CIAYN_TEST_TOKEN", "s3cret")
    base = ["call", "env_value(name='CIAYN_TEST_TOKEN')", "--tools", CIAYN_TOOLS, "--workspace", str(workspace)]
    assert cli.main(base) == 0
    assert capsys.readouterr().out.strip() == "(unset)"  # withheld by default
    assert cli.main([*base, "--pass-env", "CIAYN_TEST_TOKEN"]) == 0
    assert capsys.readouterr().out.strip() == "s3cret"
    with LocalExecutor(tools=[CIAYN_TOOLS], pass_env=["CIAYN_TEST_TOKEN"]) as client:
        from protocol import Call

        assert client.call(Call(tool="env_value", args=["CIAYN_TEST_TOKEN"], id="env-1")).value == "s3cret"


def test_ciayn_only_options_on_the_react_backend_are_named(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with LLMStub(["nothing to do"]) as stub:
        argv = ["run", "x", "--model", "openai/stub", "--api-base", stub.api_base, "--backend", "react",
                "--grammar", "on", "--tools", CIAYN_TOOLS, "--workspace", str(workspace)]
        assert cli.main(argv) == 0
    assert "--grammar shape CIAYN replies and have no effect on the react backend" in capsys.readouterr().out
