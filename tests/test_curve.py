"""CurveZMQ on tcp: an executor with a server key encrypts; with a client key directory it admits
only those clients. Real executors, real tcp sockets on 127.0.0.1."""

from __future__ import annotations

import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controller import ExecutorClient, ExecutorUnavailable
from protocol import Call
from protocol.curve import CurveError, keygen, load_pair, load_public
from tests.conftest import FAULTY
from tests.support.net import free_port


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    server_pub, server_sec = keygen(tmp_path / "server", "server")
    _, client_sec = keygen(tmp_path / "clients", "alice")
    _, stranger_sec = keygen(tmp_path / "strangers", "mallory")
    return {"server_pub": server_pub, "server_sec": server_sec, "clients": tmp_path / "clients",
            "client_sec": client_sec, "stranger_sec": stranger_sec}


@pytest.fixture
def start_executor(tmp_path: Path) -> Iterator[Callable[..., str]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(*extra: str) -> str:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        log = open(tmp_path / f"executor{len(procs)}.log", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen([sys.executable, "-m", "executor.cli", "serve", "--tools", FAULTY,
                                       "--bind", endpoint, *extra], stdout=log, stderr=log))
        return endpoint

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


def test_keygen_writes_a_pair_with_a_private_secret_and_refuses_to_overwrite(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path, "node1")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert load_public(public) == load_pair(secret)[0]
    with pytest.raises(CurveError, match="already exists"):
        keygen(tmp_path, "node1")


def test_keygen_cli(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "executor.cli", "keygen", str(tmp_path), "bob"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "bob.key").is_file() and (tmp_path / "bob.key_secret").is_file()


def test_an_admitted_client_calls_and_others_get_no_answer(
    keys: dict[str, Path], start_executor: Callable[..., str]
) -> None:
    endpoint = start_executor("--curve-secret", str(keys["server_sec"]), "--curve-clients", str(keys["clients"]))
    server_key = load_public(keys["server_pub"])
    with ExecutorClient(endpoint, curve_server_key=server_key, curve_keys=load_pair(keys["client_sec"]),
                        connect_timeout=20) as alice:
        assert alice.call(Call(tool="echo", args=["secret stuff"])).value == "secret stuff"
    with ExecutorClient(endpoint, curve_server_key=server_key, curve_keys=load_pair(keys["stranger_sec"]),
                        connect_timeout=2) as mallory, pytest.raises(ExecutorUnavailable):
        mallory.tools()
    with ExecutorClient(endpoint, connect_timeout=2) as plain, pytest.raises(ExecutorUnavailable):
        plain.tools()


def test_without_a_client_directory_any_client_key_is_accepted_but_traffic_is_encrypted(
    keys: dict[str, Path], start_executor: Callable[..., str]
) -> None:
    endpoint = start_executor("--curve-secret", str(keys["server_sec"]))
    with ExecutorClient(endpoint, curve_server_key=load_public(keys["server_pub"]), connect_timeout=20) as anyone:
        assert anyone.call(Call(tool="echo", args=[1])).value == 1  # an ephemeral key pair
    with ExecutorClient(endpoint, connect_timeout=2) as plain, pytest.raises(ExecutorUnavailable):
        plain.tools()


def test_a_missing_or_wrong_key_file_stops_start_up_clearly(tmp_path: Path, keys: dict[str, Path]) -> None:
    for args, expected in (
        (["--curve-secret", str(tmp_path / "nope.key_secret")], "cannot read the CurveZMQ key file"),
        (["--curve-secret", str(keys["server_pub"])], "holds no secret key"),
        (["--curve-clients", str(keys["clients"])], "needs --curve-secret"),
    ):
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "executor.cli", "serve", "--tools", FAULTY, "--bind",
                              f"tcp://127.0.0.1:{free_port()}", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and expected in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        assert time.monotonic() - started < 30


def test_ciayn_call_reaches_a_curve_executor_with_key_files(keys: dict[str, Path],
                                                           start_executor: Callable[..., str]) -> None:
    endpoint = start_executor("--curve-secret", str(keys["server_sec"]), "--curve-clients", str(keys["clients"]))
    out = subprocess.run([sys.executable, "-m", "controller.cli", "call", 'echo(value="over curve")',
                          "--executor", endpoint, "--curve-server-key", str(keys["server_pub"]),
                          "--curve-key", str(keys["client_sec"])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "over curve"
