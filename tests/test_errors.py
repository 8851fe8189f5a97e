"""Every public exception of the project derives from ``CiaynError`` (and keeps its built-in base), so an
embedding program can catch the project's own errors in one ``except``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import controller
import executor
import protocol
from protocol import CiaynError

# Errors of the internal channels between our own processes (and a CLI's private usage error): never
# raised to a user of the packages.
INTERNAL = {
    "executor.workers.framing.FrameError", "executor.workers.channel.ChannelError",
    "executor.workers.pidns._Unavailable", "executor.sandbox.overlay.Refused",
    "controller.cli.UserError", "controller.react._StopRequested",
}


def _exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for package in (protocol, executor, controller):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                    found[f"{info.name}.{name}"] = obj
    return found


def test_every_public_exception_is_a_ciayn_error() -> None:
    found = _exceptions()
    assert len(found) > 15
    assert set(found) >= INTERNAL, f"gone or renamed: {INTERNAL - set(found)}"
    outside = sorted(name for name, cls in found.items() if name not in INTERNAL and not issubclass(cls, CiaynError))
    assert outside == []


@pytest.mark.parametrize(("error", "builtin"), [
    (protocol.CallRejected, ValueError), (protocol.ProtocolError, ValueError),
    (controller.ExecutorStartError, RuntimeError)])
def test_a_ciayn_error_keeps_its_builtin_base(error: type[BaseException], builtin: type[BaseException]) -> None:
    assert issubclass(error, CiaynError) and issubclass(error, builtin)


def test_the_base_is_exported_where_users_import() -> None:
    assert protocol.CiaynError is executor.CiaynError is controller.CiaynError is CiaynError
