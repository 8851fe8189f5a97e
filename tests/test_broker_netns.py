"""A pool across "hosts": the broker, two executors and a controller each in its own network namespace,
joined to the broker's by veth pairs, so every message crosses real addresses over tcp, with CurveZMQ
on both broker sockets, as it would between machines. Needs root and ``ip netns``; skipped otherwise."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol.curve import keygen
from tests.support.pool import POOL_TOOLS, ROOT, Pool
from tests.support.waiting import wait_until

TAG = f"{os.getpid() % 100000}"
HOSTS = ("broker", "exec1", "exec2", "ctl")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _netns_usable() -> str:
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    probe = f"ciayn-probe-{TAG}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"ip netns does not work here: {e}"
    return ""


@pytest.fixture
def hosts() -> Iterator[dict[str, str]]:
    """Namespace per host; host N (1..3) reaches the broker at 10.231.N.1 over its own veth pair."""
    why = _netns_usable()
    if why:
        pytest.skip(why)
    names = {h: f"ciayn-{TAG}-{h}" for h in HOSTS}
    try:
        for ns in names.values():
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for n, host in enumerate(HOSTS[1:], 1):
            near, far = f"cb{TAG}{n}"[:15], f"cp{TAG}{n}"[:15]
            _ip("link", "add", near, "type", "veth", "peer", "name", far)
            _ip("link", "set", near, "netns", names["broker"])
            _ip("link", "set", far, "netns", names[host])
            _ip("-n", names["broker"], "addr", "add", f"10.231.{n}.1/24", "dev", near)
            _ip("-n", names[host], "addr", "add", f"10.231.{n}.2/24", "dev", far)
            _ip("-n", names["broker"], "link", "set", near, "up")
            _ip("-n", names[host], "link", "set", far, "up")
        yield names
    finally:
        for ns in names.values():
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                _ip("netns", "del", ns)  # takes its end of the veth pairs with it


def test_broker_executors_and_controller_on_separate_hosts_over_tcp_with_curve(
        hosts: dict[str, str], tmp_path: Path) -> None:
    broker_pub, broker_sec = keygen(tmp_path / "broker", "broker")
    keygen(tmp_path / "clients", "ctl")
    for name in ("exec1", "exec2"):
        keygen(tmp_path / "executors", name)
    pool = Pool(tmp_path, frontend="tcp://10.231.3.1:5555", backend="tcp://0.0.0.0:5556")
    try:
        def on(host: str) -> list[str]:
            return ["ip", "netns", "exec", hosts[host]]

        pool.start_broker("--frontend", "tcp://0.0.0.0:5555", "--curve-secret", str(broker_sec),
                          "--curve-clients", str(tmp_path / "clients"), "--curve-executors",
                          str(tmp_path / "executors"), prefix=on("broker"))
        for n, host in enumerate(("exec1", "exec2"), 1):
            pool.backend = f"tcp://10.231.{n}.1:5556"
            pool.add_executor([POOL_TOOLS], 2, "--curve-secret", str(tmp_path / "executors" / f"{host}.key_secret"),
                              "--curve-server-key", str(broker_pub), prefix=on(host))
        curve = ["--curve-server-key", str(broker_pub), "--curve-key", str(tmp_path / "clients" / "ctl.key_secret")]

        def status() -> dict[str, Any] | None:
            out = subprocess.run([*on("ctl"), sys.executable, "-m", "executor.cli", "status", pool.frontend, "--json",
                                  "--timeout", "2", *curve], cwd=ROOT, capture_output=True, text=True, timeout=30)
            return json.loads(out.stdout) if out.returncode == 0 else None

        wait_until("both executors to join across the veth pairs",
                   lambda: (r := status()) is not None and len(r["executors"]) == 2)
        out = tmp_path / "ctl.jsonl"
        ctl = subprocess.run([*on("ctl"), sys.executable, str(ROOT / "tests" / "tools" / "pool_controller.py"),
                              pool.frontend, "ctl", "40", str(tmp_path / "side.log"), str(out), "8",
                              "--curve-server-key", str(broker_pub), "--curve-key",
                              str(tmp_path / "clients" / "ctl.key_secret")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert ctl.returncode == 0, ctl.stderr[-2000:]
        answers = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(answers) == 40 and all(a["ok"] and a["got_tag"] == a["tag"] for a in answers)
        report = status()
        assert report is not None
        served = [e["served"] for e in report["executors"]]
        assert sum(served) == 40 and all(n > 0 for n in served), served
        assert pool.broker is not None
        assert "without CurveZMQ" not in pool.log(pool.broker)
    finally:
        pool.stop()
