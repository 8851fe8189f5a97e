"""The benchmark harness (``python -m scripts.benchmarks``, what scripts/bench runs) runs every code path at
a tiny size, so it cannot rot.

The figures themselves are not asserted (they mean nothing at this size, on a loaded machine): only
that the results file has every figure, each with the machine it ran on and either its numbers or a
"not built yet" entry saying what is missing, and that the charts and the table are written. "Every
figure" is what the harness's registry declares (``--list``), never a list kept here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS = [sys.executable, "-m", "scripts.benchmarks"]
MEASURED, NOT_BUILT = "measured", "not built yet"
ROUND_TRIP = ("floor_zmq_echo", "ours_dealer", "ours_client", "ours_reuse_workers", "ours_hardened",
              "ours_broker_tcp", "in_process", "jupyter_kernel", "fresh_python")
MACHINE = ("cores", "cpu_model", "python", "pyzmq", "libzmq", "load_avg_1m")

pytest.importorskip("matplotlib", reason="the bench extra is not installed (scripts/setup installs it)")
pytest.importorskip("jupyter_client", reason="the bench extra is not installed (scripts/setup installs it)")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench")
    readmes = (ROOT / "README.md", ROOT / "bench-results" / "README.md")
    before = [path.read_text() for path in readmes]
    done = subprocess.run([*HARNESS, "--tiny", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=280, check=False)
    for path, text in zip(readmes, before, strict=True):
        assert path.read_text() == text, f"a tiny run must never touch {path.relative_to(ROOT)}"
    assert (out / "results.json").exists(), f"no results.json; stderr:\n{done.stderr[-3000:]}"
    return out, json.loads((out / "results.json").read_text()), done.stderr


def _ok(entry: dict[str, Any], where: str) -> bool:
    """True for measured, False for not built yet; anything else fails with the harness's reason."""
    assert entry.get("status") in (MEASURED, NOT_BUILT), f"{where}: {entry.get('status')}: {entry.get('reason')}"
    if entry["status"] == NOT_BUILT:
        assert entry.get("reason"), f"{where}: a 'not built yet' entry must say what is missing"
    return bool(entry["status"] == MEASURED)


def _figures() -> list[str]:
    """The figures the harness declares, as ``--list`` prints them (name first on each line)."""
    listed = subprocess.run([*HARNESS, "--list"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


@pytest.mark.timeout(300)
def test_tiny_run_records_every_figure_with_its_machine(tiny_run: tuple[Path, dict[str, Any], str]) -> None:
    _out, results, _stderr = tiny_run
    assert set(results["features"]) >= {"reuse_workers", "hardened", "broker"}
    figures = _figures()
    assert figures, "the harness declares no figure"
    for key in figures:
        figure = results["figures"].get(key)
        assert figure is not None, f"figure {key} is missing"
        _ok(figure, key)
        assert set(figure["machine"]) >= set(MACHINE), f"{key}: machine record incomplete"


@pytest.mark.timeout(300)
def test_round_trip_has_every_contestant_with_p50_p99_and_a_ratio(tiny_run: tuple[Path, dict[str, Any], str]) -> None:
    figure = tiny_run[1]["figures"]["round_trip"]
    assert _ok(figure, "round_trip")
    for key in ROUND_TRIP:
        entry = figure["entries"].get(key)
        assert entry is not None, f"round trip entry {key} is missing"
        if _ok(entry, key):
            assert entry["latency"]["p50"] > 0 and entry["latency"]["p99"] >= entry["latency"]["p50"]
            assert entry["ratio_to_floor"] > 0
    for key, needed in (("ours_reuse_workers", "reuse_workers"), ("ours_hardened", "hardened"),
                        ("ours_broker_tcp", "broker")):
        built = tiny_run[1]["features"][needed]
        assert (figure["entries"][key]["status"] != NOT_BUILT) == built, f"{key} must follow what --help offers"
    assert {"ours_dealer_vs_floor (issue 14)", "jupyter_vs_ours_dealer (issue 14)"} <= set(figure["targets"])


@pytest.mark.timeout(300)
def test_call_path_breakdown_faults_pool_ciayn_and_memory_have_their_numbers(
        tiny_run: tuple[Path, dict[str, Any], str]) -> None:
    figures = tiny_run[1]["figures"]
    path = figures["call_path"]
    assert _ok(path, "call_path")
    assert path["hops_us"] and path["codec_us"] and path["split_us"] and path["executor_client_us"]
    assert any(name.startswith("supervisor") for name in path["cpu_per_call"]), path["cpu_per_call"]
    assert path["paced"]["calls"] >= 4 and path["paced"]["split_us"]["round trip"] > 0
    assert path["paced"]["floor_echo_p50_us"] > 0
    weight = figures["weight"]
    assert _ok(weight, "weight") and weight["p50_us"]["zmq_echo_paced"] > 0
    cuts = figures["call_path_cuts"]
    assert _ok(cuts, "call_path_cuts") and _ok(cuts["entries"]["as shipped"], "cuts: as shipped")
    for name, entry in cuts["entries"].items():
        if _ok(entry, f"cuts: {name}"):
            assert entry["latency"]["p50"] > 0 and entry["cpu_per_call_us"] > 0

    recovery = figures["recovery"]
    assert _ok(recovery, "recovery")
    assert _ok(recovery["entries"]["ours"], "recovery ours") and recovery["entries"]["ours"]["recovery"]["p50"] > 0
    _ok(recovery["entries"]["ours_hardened"], "recovery hardened")
    assert _ok(recovery["entries"]["jupyter_kernel"], "recovery jupyter")

    timeouts = figures["timeout_precision"]
    assert _ok(timeouts, "timeout_precision") and "p99" in timeouts["overshoot"] and timeouts["overshoot_ms"]

    pool = figures["pool_scaling"]
    assert _ok(pool, "pool_scaling")
    assert "default flags" in pool["modes"]
    for mode in pool["modes"].values():
        for tool in ("noop", "sleep_10ms"):
            for rates in mode["calls_per_s"][tool].values():
                assert len(rates) == len(pool["workers"]) and all(r > 0 for r in rates)

    ciayn = figures["ciayn_overhead"]
    assert _ok(ciayn, "ciayn_overhead")
    assert {"parse (grammar, ast)", "fingerprint (repeat detection)", "encode the call (protocol.encode)"} <= set(
        ciayn["stages_us"])

    memory = figures["memory"]
    assert _ok(memory, "memory") and memory["supervisor_rss_mb"] > 0 and memory["worker_uss_mb"]


@pytest.mark.timeout(300)
def test_charts_and_table_are_written(tiny_run: tuple[Path, dict[str, Any], str]) -> None:
    out, results, _ = tiny_run
    table = (out / "results.md").read_text()
    for key, figure in results["figures"].items():
        if figure["status"] == MEASURED and key not in ("hardened_layers", "broker_pool"):  # tables only
            png = out / f"{key}.png"
            assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"no chart for {key}"
            assert f"]({key}.png)" in table, f"the table does not embed the {key} chart"
        assert figure["title"] in table, f"the table does not mention {key}"


def test_the_fresh_worker_benchmark_records_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "fresh.json"
    subprocess.run([sys.executable, "-m", "scripts.benchmarks.fresh", "--quick", "--out", str(out)],
                   cwd=Path(__file__).resolve().parent.parent, check=True, capture_output=True, timeout=240)
    fresh = json.loads(out.read_text())
    for figure in ("low_load_p50_us", "back_to_back_p50_us", "throughput_calls_per_s", "supervisor_rss_mb"):
        assert set(fresh[figure]) == {"fresh", "reuse_workers"} and all(v > 0 for v in fresh[figure].values())
    assert set(fresh["targets"]) == {"fresh_vs_reuse_low_load_p50", "fresh_throughput"}


@pytest.mark.timeout(120)
def test_ab_times_two_trees_side_by_side() -> None:
    """``scripts.benchmarks.ab``, what a change to the call path quotes, at a tiny size on this tree
    against itself: every measure has a positive pooled ratio and a range over the sessions."""
    done = subprocess.run([*HARNESS[:2], "scripts.benchmarks.ab", ".", "--sessions", "2", "--rounds", "2",
                           "--calls", "6"], cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line[:13].strip(): line[13:].split() for line in done.stdout.splitlines()}
    assert len(rows["after/before"]) == 4 and all(float(r) > 0 for r in rows["after/before"])
    assert len(rows["by session"]) == 12  # "low - high" for each of the four measures
    assert "supervisor: main" in done.stdout and "template: main" in done.stdout
