"""Shared by the tool modules that forge the hardened keepers' own notice (``redteam_ceiling_resend.py``,
``overlay_attacks.py``): ``applying`` tells the supervisor a call's changes are being applied to the
workspace, which gives the call the apply grace (60 s more). A hostile tool writes it on its worker's
channel to the supervisor; the tests check that it is not believed. Not a tool module itself.

A tool module loaded by path finds this file beside it with::

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from forged_notice import forge_applying
"""

from __future__ import annotations

import os
import stat

from executor.workers import framing

SEQS = 64  # every sequence number a call may have


def forge_applying() -> None:
    """Send the ``applying`` notice on every socket descriptor above stdio (the worker's channel is
    one of them) for every sequence number a call may have."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if fd > 2 and stat.S_ISSOCK(os.fstat(fd).st_mode):
                for seq in range(SEQS):
                    os.write(fd, framing.pack({"op": "applying", "seq": seq}))
        except OSError:
            continue
