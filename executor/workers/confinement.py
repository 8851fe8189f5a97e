"""What a profile does to the workers the template forks: the ``Confinement`` the template is given.

The default profile has none (``WorkerConfig.confinement`` is None): workers run with the rlimits,
control groups and dropped capabilities that ``executor.workers.template`` and
``executor.workers.worker`` give them. The hardened profile
(``executor.sandbox.profile.Sandbox``) implements this interface and is passed in, never looked up: to the
first template in its ``WorkerConfig``, to a template started afresh as plain data in its
``Configure`` (``to_wire``), rebuilt there by ``from_wire`` from the module the data names. So
nothing under ``executor/workers/`` imports the hardened profile, and a default template carries
none of its code.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol


class Confinement(Protocol):
    """The template calls ``before_fork`` and ``after_fork`` around each worker's fork; the worker
    calls ``enter`` before it reads its call."""

    names: list[str]  # the layers every worker runs under: what a result's ``worker.layers`` says
    keeper: bool  # workers apply each call's workspace writes after it: only they may send ``Applying``

    def before_fork(self) -> None: ...

    def after_fork(self, pid: int) -> None: ...

    def enter(self) -> list[str]: ...

    def to_wire(self) -> dict[str, Any]: ...


def from_wire(obj: dict[str, Any]) -> Confinement:
    """The confinement ``Confinement.to_wire`` described, rebuilt by ``restore(state)`` of the module
    it names (one of the executor's own: the data comes from the supervisor, never from a tool)."""
    module = str(obj["module"])
    if not module.startswith("executor.") or module.startswith("executor.workers"):
        raise ValueError(f"a confinement must come from the executor's profiles, not {module!r}")
    restored: Confinement = importlib.import_module(module).restore(obj["state"])
    return restored
