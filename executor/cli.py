"""``ciayn-executor``: serve tools to controllers."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from protocol import Limits

DESCRIPTION = """\
Run tool calls for ciayn-sandbox controllers, each in a supervised worker process under resource
limits. A tool that hangs, crashes, forks or eats memory costs one worker, which is killed and
replaced; the caller gets a clear error.
"""

SERVE_EPILOG = """\
examples:
  ciayn-executor serve --tools executor.toolkits.builtin --bind ipc:///tmp/ciayn/exec.sock
  ciayn-executor serve --tools ./my_tools.py --bind tcp://127.0.0.1:5555 --workers 4 --timeout 10

Tools are plain functions marked with @executor.tool(...) or listed in the module's __all__.
"""


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if not 0 < value < float("inf"):  # also refuses nan, which compares false
            raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
        return value

    parse.__name__ = getattr(kind, "__name__", "number")
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ciayn-executor", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve tool modules on an endpoint", description=DESCRIPTION,
                           epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--tools", action="append", required=True, metavar="MODULE",
                       help="dotted module name or path to a .py file holding tools (repeatable)")
    serve.add_argument("--bind", required=True, metavar="ENDPOINT",
                       help="ZeroMQ endpoint to listen on, e.g. ipc:///run/ciayn.sock or tcp://127.0.0.1:5555")
    d = Limits()
    serve.add_argument("--workers", type=_positive(int), default=1, help="worker processes (default: 1)")
    serve.add_argument("--timeout", type=_positive(float), default=d.timeout_s,
                       help=f"default wall-clock limit per call, seconds (default: {d.timeout_s:g})")
    serve.add_argument("--cpu-s", type=_positive(float), default=None,
                       help="CPU seconds per call (default: the timeout plus 1)")
    serve.add_argument("--memory-mb", type=_positive(int), default=d.memory_mb,
                       help=f"memory per worker, MB (default: {d.memory_mb})")
    serve.add_argument("--max-output-kb", type=_positive(int), default=d.max_output_kb,
                       help=f"cap on stdout and on stderr per call, KB (default: {d.max_output_kb})")
    serve.add_argument("--max-result-kb", type=_positive(int), default=d.max_result_kb,
                       help=f"cap on the encoded return value, KB (default: {d.max_result_kb})")
    serve.add_argument("--max-queue", type=_positive(int), default=256,
                       help="calls waiting for a worker before new ones are refused (default: 256)")
    serve.add_argument("--profile", choices=["default"], default="default",
                       help="isolation profile (default: rlimits, subreaper, whole-tree kill)")
    serve.add_argument("--no-cgroups", action="store_true",
                       help="do not put workers in control groups even where the machine offers them "
                       "(by default, as root: a memory and a pids group per worker, killed as a whole)")
    serve.add_argument("--max-processes", type=_positive(int), default=d.processes,
                       help=f"processes per worker, where a pids cgroup enforces it (default: {d.processes})")
    serve.add_argument("--workspace", metavar="DIR", default=None,
                       help="root directory the file tools are confined to; the workers' cwd (default: cwd)")
    serve.add_argument("--parent-pid", type=int, default=None, metavar="PID",
                       help="exit when this process exits (used by controllers that start the executor)")
    serve.add_argument("--curve-secret", metavar="FILE",
                       help="CurveZMQ: encrypt every connection with this server key (a .key_secret file "
                       "from `ciayn-executor keygen`)")
    serve.add_argument("--curve-clients", metavar="DIR",
                       help="CurveZMQ: accept only clients whose public key file is in DIR (needs --curve-secret)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="stderr log verbosity (default: info)")
    keygen = sub.add_parser("keygen", help="write a CurveZMQ key pair (NAME.key, NAME.key_secret) into DIR",
                            description="Write a CurveZMQ key pair for an executor or a client: DIR/NAME.key is "
                            "the public key (give it to the other side), DIR/NAME.key_secret the secret one "
                            "(mode 0600).")
    keygen.add_argument("dir", metavar="DIR")
    keygen.add_argument("name", metavar="NAME")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=getattr(args, "log_level", "info").upper(),
                        format=f"ciayn-executor[{os.getpid()}] %(levelname)s %(message)s")
    if args.command == "serve":
        return _serve(args)
    if args.command == "keygen":
        from executor.curve import CurveError, keygen

        try:
            public, secret = keygen(args.dir, args.name)
        except (CurveError, OSError) as e:
            print(f"ciayn-executor: {e}", file=sys.stderr)
            return 1
        print(f"public key: {public}\nsecret key: {secret} (keep it private)")
        return 0
    return 2


def _serve(args: argparse.Namespace) -> int:
    from executor.supervisor import StartupError, Supervisor

    if args.workspace and not os.path.isdir(args.workspace):
        print(f"ciayn-executor: workspace {args.workspace!r} is not a directory", file=sys.stderr)
        return 2
    if args.curve_clients and not args.curve_secret:
        print("ciayn-executor: --curve-clients needs --curve-secret (the server's own key)", file=sys.stderr)
        return 2
    # File paths of tool modules are relative to where the command ran, not to --workspace (the
    # executor changes into the workspace before it imports them).
    args.tools = [os.path.abspath(t) if t.endswith(".py") or os.sep in t else t for t in args.tools]
    limits = Limits(timeout_s=args.timeout, cpu_s=args.cpu_s, memory_mb=args.memory_mb,
                    max_output_kb=args.max_output_kb, max_result_kb=args.max_result_kb,
                    processes=args.max_processes)
    supervisor = Supervisor(
        args.tools, args.bind, limits=limits, workers=args.workers, max_queue=args.max_queue,
        workspace=args.workspace, parent_pid=args.parent_pid, profile=args.profile,
        use_cgroups=not args.no_cgroups, curve_secret=args.curve_secret, curve_clients=args.curve_clients,
    )
    try:
        return supervisor.serve()
    except StartupError as e:
        print(f"ciayn-executor: cannot start: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
