"""The CI recipe of ``docs/ci.md``, run for real: the block of commands it gives, in a fresh repository,
as a CI job would run it, with a scripted model server (tests/llm_stub.py) standing in for the
hosted model. ``ciayn run --profile hardened`` starts a hardened private executor (its selfcheck
gating the run), the model drives ``run_shell``, the network is denied to it (the model server on
the host's loopback included), and with ``--workspace-rw`` what it wrote is in the repository.
Needs root and the kernel's layers; elsewhere it skips, naming what is missing."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from llm_stub import LLMStub

from controller import ExecutorClient, cli
from executor.sandbox import layers

ROOT = Path(__file__).parent.parent
CI_DOC = ROOT / "docs" / "ci.md"
MISSING = layers.probe_all()
RUN_WITHIN = 240  # seconds: Python, the hardened selfcheck and three model steps on a loaded machine


def _recipe() -> str:
    """The shell block after the ``ci-recipe`` marker."""
    text = CI_DOC.read_text()
    found = re.search(r"<!-- ci-recipe:.*?-->\s*```sh\n(.*?)```", text, re.S)
    assert found, "docs/ci.md has no ci-recipe block"
    return found.group(1)


def _commands(block: str) -> list[str]:
    """Its commands, continuation lines joined, whitespace normalised."""
    return [" ".join(c.split()) for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def test_the_github_actions_job_runs_the_same_commands_as_the_recipe() -> None:
    text = CI_DOC.read_text()
    job = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert job, "docs/ci.md has no job"
    flat = " ".join(job.group(1).replace("\\\n", " ").split())
    for command in _commands(_recipe()):
        assert command in flat, f"the job does not run: {command}"


@pytest.mark.skipif(bool(MISSING), reason=f"this machine lacks hardened layers: {MISSING}")
@pytest.mark.timeout(RUN_WITHIN + 60)
def test_the_ci_recipe_runs_run_shell_hardened_without_network_and_keeps_its_writes(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README").write_text("a repository\n")
    listener = socket.create_server(("127.0.0.1", 0))  # what a tool with network would reach
    port = listener.getsockname()[1]
    reach = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 3)\""
    script = [f"run_shell(command={reach!r})", "run_shell(command='echo fixed > fixed.txt && cat fixed.txt')",
              'complete_task(summary="fixed")']
    with LLMStub(script) as stub:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               "CIAYN_MODEL": "openai/stub", "CIAYN_API_BASE": stub.api_base, "CIAYN_BACKEND": "ciayn",
               "TASK": "Fix the repository"}
        env.pop("OPENAI_API_KEY", None)
        job = subprocess.run(["sh", "-e", "-c", _recipe()], cwd=repo, env=env, capture_output=True, text=True,
                             timeout=RUN_WITHIN, stdin=subprocess.DEVNULL)
        assert job.returncode == 0, f"stdout:\n{job.stdout}\nstderr:\n{job.stderr}"
        assert len(stub.requests) == len(script)
    events: list[dict[str, Any]] = [json.loads(line) for line in (repo / "transcript.jsonl").read_text().splitlines()]
    assert json.loads(job.stdout.splitlines()[-1]) == events[-1]  # `tail -n 1`: the run's end
    assert events[-1]["event"] == "finished" and events[-1]["status"] == "completed", events[-1]
    notices = " ".join(e.get("text", "") for e in events if e["event"] == "notice")
    assert "hardened private executor" in notices and "selfcheck" in notices, notices
    shell = [e for e in events if e["event"] == "tool_result" and e["tool"] == "run_shell"]
    assert [e["ok"] for e in shell] == [True, True], shell
    denied, wrote = shell[0]["value"], shell[1]["value"]
    # refused before any packet left: by a layer (Landlock, seccomp), or by the network namespace
    assert denied["exit_code"] != 0, denied
    assert "Permission denied" in denied["stderr"] or "Network is unreachable" in denied["stderr"], denied
    listener.settimeout(0.1)
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    assert wrote["exit_code"] == 0 and wrote["stdout"] == "fixed\n", wrote
    assert (repo / "fixed.txt").read_text() == "fixed\n"  # --workspace-rw: applied after the call answered


@pytest.mark.skipif(bool(MISSING), reason=f"this machine lacks hardened layers: {MISSING}")
def test_a_hardened_private_executor_that_refuses_to_start_stops_the_run_before_the_model(tmp_path: Path) -> None:
    """The tools (nobody) could not read a 0700 workspace: the executor refuses, and the run with it."""
    repo = tmp_path / "private"
    repo.mkdir(mode=0o700)
    with LLMStub(['complete_task(summary="never")']) as stub:
        job = subprocess.run([sys.executable, "-m", "controller.cli", "run", "task", "--profile", "hardened",
                              "--model", "openai/stub", "--api-base", stub.api_base, "--backend", "ciayn",
                              "--workspace", str(repo)], capture_output=True, text=True, timeout=RUN_WITHIN,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL)
        assert not stub.requests, "the model was asked although the executor did not start"
    assert job.returncode == 2, job
    assert "The private executor did not start" in job.stderr and "cannot read the workspace" in job.stderr, job.stderr


def test_profile_options_that_cannot_hold_are_usage_errors(
        make_client: Callable[..., ExecutorClient], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["tools", "--workspace-rw"]) == 2
    assert "--workspace-rw is for --profile hardened" in capsys.readouterr().err
    endpoint = make_client().local.endpoint  # type: ignore[attr-defined]  # the default profile
    assert cli.main(["tools", "--executor", endpoint, "--profile", "hardened"]) == 2
    err = capsys.readouterr().err
    assert f"the executor at {endpoint} serves the 'default' profile, not hardened" in err, err
    assert cli.main(["tools", "--executor", endpoint, "--profile", "default"]) == 0


@pytest.mark.skipif(bool(MISSING), reason=f"this machine lacks hardened layers: {MISSING}")
def test_a_hardened_serve_says_that_its_selfcheck_runs_and_passed_before_it_serves(tmp_path: Path) -> None:
    sock_dir = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-m", "executor.cli", "serve", "--profile", "hardened", "--tools",
                             "executor.toolkits.builtin", "--bind", f"ipc://{sock_dir}/x.sock",
                             "--workspace", str(tmp_path), "--workspace-rw"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    watchdog = threading.Timer(RUN_WITHIN, proc.kill)  # a start that hangs ends the read below
    watchdog.start()
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # each line as it comes; the serving line ends the start
            lines.append(line)
            if " serving " in line:
                break
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.wait(30)
    stages = [next((i for i, line in enumerate(lines) if text in line), -1)
              for text in ("hardened: selfcheck: ", "hardened: selfcheck passed: ", " serving ")]
    assert -1 not in stages and stages == sorted(stages), "".join(lines)
