"""``serve --profile hardened``, before the supervisor starts: ``start_hardened`` checks the options
and the workspace, refuses when the machine lacks a layer (naming it), runs the selfcheck as a
start-up gate, and builds the profile (``profile.activate``) that the CLI passes in as the
workers' ``Confinement``. ``--allow-degraded`` turns each refusal into a loud warning.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from typing import Any

from executor.sandbox import layers, mounts, profile, selfcheck
from executor.sandbox.config import HardenedConfig
from executor.sandbox.overlay import DEFAULT_QUOTA_MB


def start_hardened(args: Any) -> int:
    """Returns 0 to go on, the profile then in ``args.confinement``; else the exit code."""
    if getattr(args, "reuse_workers", False):
        print("ciayn-executor: --reuse-workers cannot be used with --profile hardened (every hardened call "
              "runs in a fresh worker)", file=sys.stderr)
        return 2
    if args.no_cgroups:
        print("ciayn-executor: --no-cgroups cannot be used with --profile hardened (its memory, process and CPU "
              "limits are control groups)", file=sys.stderr)
        return 2
    config = _config(args)
    if problem := _workspace_problem(config):
        print(f"ciayn-executor: --profile hardened: {problem}", file=sys.stderr)
        return 2
    if config.workspace_rw and os.geteuid() == 0 and (problem := mounts.check_idmap(config.workspace)):
        print(f"ciayn-executor: --workspace-rw: the workspace {config.workspace} cannot be mounted for the "
              f"tools to write as its owner (an idmapped mount): {problem}", file=sys.stderr)
        return 1
    missing = layers.probe_all()
    if missing:
        named = "; ".join(f"{k} ({v})" for k, v in missing.items())
        if not args.allow_degraded:
            print(f"ciayn-executor: --profile hardened refused: this machine cannot give these layers: {named}. "
                  "Fix that (run as root on a kernel with namespaces, cgroups, Landlock and seccomp) or, knowing "
                  "that tools are then less confined, add --allow-degraded.", file=sys.stderr)
            return 1
        _loud(f"DEGRADED: serving without these layers: {named}")
    if not args.skip_selfcheck and (code := _gate(args)):
        return code
    sandbox = profile.activate(config)
    atexit.register(sandbox.remove_groups)
    args.confinement = sandbox
    return 0


def _config(args: Any) -> HardenedConfig:
    """The profile's configuration from the ``serve`` options: the executor's own socket directory
    and CurveZMQ secret key are hidden from the tools."""
    hide = [os.path.dirname(os.path.abspath(e[len("ipc://"):]))
            for e in (args.bind, getattr(args, "connect", None)) if e and e.startswith("ipc://") and e[6:7] != "@"]
    hide += [os.path.abspath(f) for f in (args.curve_secret,) if f]
    return HardenedConfig(
        workspace=os.path.abspath(args.workspace or os.getcwd()), workspace_rw=args.workspace_rw,
        workspace_quota_mb=getattr(args, "workspace_quota", None) or DEFAULT_QUOTA_MB,
        max_result_kb=getattr(args, "max_result_kb", None) or HardenedConfig.max_result_kb,
        hide=tuple(hide), allow_degraded=args.allow_degraded)


def _gate(args: Any) -> int:
    """Run the selfcheck: 0 when every attempt was denied (or, degraded, loudly anyway), else 1."""
    log = logging.getLogger("ciayn-executor")
    count = len(selfcheck.attempts(args.workspace_rw))
    log.info("hardened: selfcheck: %d escape attempts from a real worker, then checks of the host ...", count)
    started = time.monotonic()
    rows = selfcheck.run(workspace_rw=args.workspace_rw)
    failed = [r for r in rows if not r.ok]
    if not failed:
        log.info("hardened: selfcheck passed: %d attempts denied, the host left as it was (%.1f s)", count,
                 time.monotonic() - started)
        return 0
    text = "\n".join(f"  {r.layer}: {r.attempt}: {r.observed}" for r in failed)
    if not args.allow_degraded:
        print(f"ciayn-executor: --profile hardened refused: the selfcheck got through {len(failed)} "
              f"layer(s):\n{text}\n(`ciayn-executor selfcheck` shows the whole table; --allow-degraded "
              "serves anyway)", file=sys.stderr)
        return 1
    _loud(f"DEGRADED: the selfcheck got through {len(failed)} attempt(s):\n{text}")
    return 0


def _workspace_problem(config: HardenedConfig) -> str | None:
    """Tools run as ``config.uid``: a read-only workspace must let others in; with --workspace-rw
    they act as its owner (an idmapped mount), who must be able to write it."""
    try:
        st = os.stat(config.workspace)
    except OSError as e:
        return f"cannot use the workspace: {e}"
    if config.workspace_rw:
        if unsafe := sorted(set(",:\\") & set(os.path.realpath(config.workspace))):
            return (f"--workspace-rw: the workspace's path {os.path.realpath(config.workspace)!r} holds "
                    f"{' '.join(unsafe)}, which an overlay's layer path cannot; choose another --workspace")
        if st.st_mode & 0o700 != 0o700:
            return (f"--workspace-rw: tools act as the owner of the workspace {config.workspace}, who cannot "
                    f"read, write and enter it (mode {st.st_mode & 0o777:o}); chmod u+rwx it")
        return None
    read = 0o500 if st.st_uid == config.uid else 0o005
    if st.st_mode & read != read:
        return (f"tools run as uid {config.uid}, who cannot read the workspace {config.workspace} (mode "
                f"{st.st_mode & 0o777:o}); make it readable by others (chmod o+rx), add --workspace-rw (tools "
                "then act as its owner in it), or choose another --workspace")
    return None


def _loud(text: str) -> None:
    bar = "!" * 78
    print(f"{bar}\nciayn-executor: {text}\nciayn-executor: tools are NOT fully confined (--allow-degraded)\n{bar}",
          file=sys.stderr)
