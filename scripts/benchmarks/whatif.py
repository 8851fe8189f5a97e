"""What-if runs of the executor: ``python bench_whatif.py PATCH[,PATCH...] -- serve ARGS...`` applies
benchmark-only patches in memory, then runs ``ciayn-executor serve ARGS``. Nothing in executor/
changes; this only tells what a candidate cut of the call path would buy, measured side by side with
the executor as shipped (``callpath.call_path_cuts``).

The patches reach the supervisor only. The template is a new interpreter (``executor.workers.spawn``
execs it) and the workers are its forks, so a patch of worker code made here would never run there
and its row would measure nothing; none is offered.

Patches:
- ``nospin``: the supervisor does not poll without sleeping after a dispatch
  (``executor.pool.SPIN_AFTER_DISPATCH = 0``);
- ``nobookkeeping``: the supervisor keeps no books on a call: no at-most-once memory (no digest of
  the call, no lookup of its id, no record of it, no cached answer), no check of its arguments
  against the tool's signature, no per-tool statistics, no read of the worker's output pipes after
  its reply. Unsafe (a resent id runs again, bad arguments reach the tool): it bounds what any
  trimming of that bookkeeping could buy, not a cut to make.
- ``handcodec``: the supervisor builds a call from its msgpack body with nothing checked, and packs a
  successful result's id, value and executor by hand (other messages as shipped). Unsafe and less
  than any real codec: it bounds what a hand-written codec beside pydantic's could buy.

Exits 3 if a patch's target no longer exists (the code moved on): the what-if is then not
measured rather than measured wrong.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def _nothing(*_args: Any) -> None:
    return None


def _hand_decode() -> Callable[..., Any]:
    """``decode`` that reads a call's body with msgpack alone and checks nothing (other kinds: as shipped)."""
    import msgpack

    from protocol import codec
    from protocol.messages import Call

    shipped = codec.decode

    def decode(frames: Any, **kwargs: Any) -> Any:
        if len(frames) == 3 and bytes(frames[1]) == b"call":
            fields = {"args": [], "kwargs": {}, **msgpack.unpackb(bytes(frames[2]), raw=False)}
            return Call.model_construct(**fields)  # (a default_factory left out costs an inspect.signature)
        return shipped(frames, **kwargs)

    return decode


def _hand_encode() -> Callable[..., Any]:
    """``encode`` that packs a successful result's id, value and executor by hand (nothing else of it:
    less than any real encoder would send; other messages: as shipped)."""
    import msgpack

    from protocol import codec

    shipped = codec.encode

    def encode(msg: Any, **kwargs: Any) -> list[bytes]:
        if getattr(msg, "KIND", "") == "result" and msg.ok:
            body = {"id": msg.id, "ok": True, "value": msg.value, "executor": msg.executor}
            return [codec.VERSION, b"result", msgpack.packb(body, use_bin_type=True)]
        return shipped(msg, **kwargs)

    return encode


# name: [(module, attribute or Class.attribute, its replacement)]
PATCHES: dict[str, list[tuple[str, str, Callable[[], object]]]] = {
    "nospin": [("executor.pool", "SPIN_AFTER_DISPATCH", lambda: 0.0)],
    "handcodec": [("executor.clientside.router", "decode", _hand_decode),
                  ("executor.supervisor", "encode", _hand_encode)],
    "nobookkeeping": [
        ("executor.supervisor", "fingerprint", lambda: lambda call: (0, 0)),
        ("executor.calls", "CallTable.seen", lambda: _nothing),
        ("executor.calls", "AtMostOnce.record", lambda: _nothing),
        ("executor.calls", "AtMostOnce.remember", lambda: _nothing),
        ("protocol.spec", "ToolSpec.bind", lambda: lambda self, args, kwargs: {}),
        ("protocol.spec", "ToolSpec.check_arguments", lambda: _nothing),
        ("executor.metrics", "CallStats.observe", lambda: _nothing),
        ("executor.slot", "Worker.drain", lambda: _nothing),
    ],
}


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: bench_whatif.py PATCH[,PATCH...] -- serve ARGS...", file=sys.stderr)
        return 2
    split = argv.index("--")
    names = [n for n in ",".join(argv[:split]).split(",") if n]
    for name in names:
        if name not in PATCHES:
            print(f"bench_whatif: unknown patch {name!r} (known: {', '.join(PATCHES)})", file=sys.stderr)
            return 2
        for module_name, path, value in PATCHES[name]:
            *owners, attr = path.split(".")
            target: Any = importlib.import_module(module_name)
            for owner in owners:
                target = getattr(target, owner, None)
            if target is None or not hasattr(target, attr):
                print(f"bench_whatif: {module_name}.{path} no longer exists; patch {name} cannot apply",
                      file=sys.stderr)
                return 3
            setattr(target, attr, value())
    from executor.cli import main as executor_main

    return executor_main(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
