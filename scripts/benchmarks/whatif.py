"""What-if runs of the executor: ``python bench_whatif.py PATCH[,PATCH...] -- serve ARGS...`` applies
benchmark-only patches in memory, then runs ``ciayn-executor serve ARGS``. The template and the
workers are forked from that process, so they carry the patches too. Nothing in executor/ changes;
this only tells what a candidate cut of the call path would buy, measured side by side with the
executor as shipped (``callpath.call_path_cuts``).

Patches:
- ``nospin``: the supervisor does not poll without sleeping after a dispatch
  (``executor.pool.SPIN_AFTER_DISPATCH = 0``);
- ``noclearrefs``: the worker does not reset its peak RSS before each call
  (``executor.workers.worker._reset_peak_rss`` does nothing; a call's peak memory is then the worker's).

Exits 3 if a patch's target no longer exists (the code moved on): the what-if is then not
measured rather than measured wrong.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

PATCHES: dict[str, tuple[str, str, Callable[[], object]]] = {
    "nospin": ("executor.pool", "SPIN_AFTER_DISPATCH", lambda: 0.0),
    "noclearrefs": ("executor.workers.worker", "_reset_peak_rss", lambda: (lambda: None)),
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
        module_name, attr, value = PATCHES[name]
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            print(f"bench_whatif: {module_name}.{attr} no longer exists; patch {name} cannot apply", file=sys.stderr)
            return 3
        setattr(module, attr, value())
    from executor.cli import main as executor_main

    return executor_main(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
