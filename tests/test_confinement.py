"""A template rebuilds its confinement from plain data naming a module: only the executor's own
profiles outside workers/ may be named, so a Configure cannot make a template import anything else."""

from __future__ import annotations

import pytest

from executor.workers import confinement


@pytest.mark.parametrize("module", ["os", "subprocess", "executor.workers.worker", "executorx.evil", ""])
def test_a_confinement_naming_another_module_is_refused(module: str) -> None:
    with pytest.raises(ValueError, match="executor's profiles"):
        confinement.from_wire({"module": module, "state": {}})


def test_the_hardened_profile_round_trips(tmp_path: object) -> None:
    from executor.sandbox.config import HardenedConfig
    from executor.sandbox.layers import LAYERS
    from executor.sandbox.profile import Sandbox

    sandbox = Sandbox(HardenedConfig(workspace=str(tmp_path)), tuple(LAYERS))
    back = confinement.from_wire(sandbox.to_wire())
    assert isinstance(back, Sandbox) and back.names == sandbox.names and back.keeper == sandbox.keeper
