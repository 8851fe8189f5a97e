"""``ciayn-executor``: serve tools to controllers."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from executor.workers.privacy import reexec_without_secrets
from protocol import Limits
from protocol.environment import check_pass_env
from protocol.messages import MAX_TIMEOUT_S

DESCRIPTION = """\
Run tool calls for ciayn-sandbox controllers, each in a supervised worker process under resource
limits. A tool that hangs, crashes, forks or eats memory costs one worker, which is killed and
replaced; the caller gets a clear error.
"""

SERVE_EPILOG = """\
examples:
  ciayn-executor serve --tools executor.toolkits.builtin --bind ipc:///tmp/ciayn/exec.sock
  ciayn-executor serve --tools ./my_tools.py --bind tcp://0.0.0.0:5555 --workers 4 --timeout 10 \\
      --max-timeout 60 --curve-secret keys/executor.key_secret --curve-clients keys/clients
  ciayn-executor serve --tools executor.toolkits.builtin --connect ipc:///run/ciayn/pool-backend.sock --workers 4

Over tcp, CurveZMQ: `ciayn-executor keygen keys executor` writes the key pair, and keys/clients holds
the public key file (NAME.key, from `ciayn-executor keygen DIR NAME`) of each client admitted. Tools
are plain functions marked with @executor.tool(...) or listed in the module's __all__.
"""


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if not 0 < value < float("inf"):  # also refuses nan, which compares false
            raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
        return value

    parse.__name__ = getattr(kind, "__name__", "number")
    return parse


LOG_LEVELS = ("debug", "info", "warning", "error")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ciayn-sandbox")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _log_options(p: argparse.ArgumentParser) -> None:
    """--log-level and -v, worded as ``ciayn``'s (the same default: info)."""
    p.add_argument("--log-level", choices=LOG_LEVELS, metavar="LEVEL", default=None,
                   help="log verbosity on stderr, with timestamps: debug, info, warning, error (default: info)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output: -v is --log-level debug")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that an unknown option after a command is answered with that
    command's usage (``serve --bogus``: serve's usage, not the top level's)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = str(getattr(args, "command", ""))
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subparsers.choices.get(command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ciayn-executor", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve_parser(sub)
    _add_broker_parser(sub)
    _add_status_parser(sub)
    _add_selfcheck_parser(sub)
    _add_keygen_parser(sub)
    return parser


def _add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser("serve", help="serve tool modules on an endpoint", description=DESCRIPTION,
                           epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--tools", action="append", required=True, metavar="MODULE",
                       help="dotted module name or path to a .py file holding tools (repeatable)")
    where = serve.add_mutually_exclusive_group(required=True)
    where.add_argument("--bind", metavar="ENDPOINT",
                       help="ZeroMQ endpoint to listen on, e.g. ipc:///run/ciayn.sock or tcp://127.0.0.1:5555")
    where.add_argument("--connect", metavar="ENDPOINT",
                       help="join a pool instead: connect to a broker's backend endpoint (`ciayn-executor broker`). "
                       "It reconnects by itself; if the broker refuses it (another executor serves a tool of the "
                       "same name differently, or a live executor on another connection holds its id) it does not "
                       "stop: it logs why and announces itself again after 1 s, doubling up to 10 s, until the "
                       "conflict is gone")
    serve.add_argument("--workspace", metavar="DIR", default=None,
                       help="root directory the file tools are confined to; the workers' cwd (default: cwd)")
    _serve_workers_and_limits(serve.add_argument_group("workers and limits"))
    _serve_isolation(serve.add_argument_group("isolation"))
    _serve_exposure(serve.add_argument_group("keys and exposure"))
    serve.add_argument("--parent-pid", type=int, default=None, metavar="PID",
                       help="exit when this process exits (used by controllers that start the executor)")
    serve.add_argument("--metrics-port", metavar="[HOST:]PORT",
                       help="serve Prometheus metrics over HTTP on this port (127.0.0.1 unless HOST is given)")
    _log_options(serve)


def _serve_workers_and_limits(group: argparse._ArgumentGroup) -> None:
    """``serve``'s workers, their limits and the queue."""
    d = Limits()
    group.add_argument("--workers", metavar="N", type=_positive(int), default=1,
                       help="calls run at once (default: 1); each call gets a fresh worker process, and as many "
                       "are kept forked ahead")
    group.add_argument("--reuse-workers", action="store_true",
                       help="TOOLS ARE TRUSTED: run call after call in the same worker process, so tools can keep "
                       "state across calls; a call can then see and change what earlier calls left, and limits "
                       "are soft (a tool can lift them)")
    group.add_argument("--pass-env", action="append", default=[], metavar="NAME",
                       help="hand this environment variable to tools (repeatable; NAME_* for a prefix). Tools "
                       "see only PATH, HOME, LANG, LC_*, TZ, TMPDIR and these; never the executor's secrets")
    group.add_argument("--timeout", type=_positive(float), default=None, metavar="S",
                       help="wall-clock limit of a call that sets none, seconds: a call's own timeout wins over "
                       "its tool's @tool(timeout=...), which wins over this one; each may be longer or shorter "
                       f"(default: {d.timeout_s:g}, or --max-timeout if less)")
    group.add_argument("--max-timeout", type=_positive(float), default=None, metavar="S",
                       help="the longest any call may run, seconds: a ceiling on every timeout, whether the "
                       "call, its tool or --timeout set it; a call asking for more runs under this one and its "
                       f"timeout error says so. Reported in hello and status (default: {MAX_TIMEOUT_S:g}, a day)")
    group.add_argument("--cpu-s", metavar="S", type=_positive(float), default=None,
                       help="CPU seconds per call (default: the timeout plus 1)")
    group.add_argument("--memory-mb", metavar="MB", type=_positive(int), default=d.memory_mb,
                       help=f"memory per worker, MB (default: {d.memory_mb})")
    group.add_argument("--max-output-kb", metavar="KB", type=_positive(int), default=d.max_output_kb,
                       help=f"cap on stdout and on stderr per call, KB (default: {d.max_output_kb})")
    group.add_argument("--max-result-kb", metavar="KB", type=_positive(int), default=d.max_result_kb,
                       help=f"cap on the encoded return value, KB (default: {d.max_result_kb})")
    group.add_argument("--max-queue", metavar="N", type=_positive(int), default=256,
                       help="calls waiting for a worker before new ones are refused (default: 256)")
    group.add_argument("--max-queue-mb", metavar="MB", type=_positive(int), default=1024,
                       help="encoded arguments of the calls waiting for a worker, MiB, before new ones are refused "
                       "(default: 1024)")
    group.add_argument("--max-queue-wait", metavar="S", type=_positive(float), default=600.0,
                       help="seconds a call may wait for a worker before it is answered `unavailable` without "
                       "running; a call never waits longer than its own timeout either (default: 600)")
    group.add_argument("--no-cgroups", action="store_true",
                       help="do not put workers in control groups even where the machine offers them "
                       "(by default, as root: a memory and a pids group per worker, killed as a whole)")
    group.add_argument("--max-processes", metavar="N", type=_positive(int), default=d.processes,
                       help=f"processes per worker, where a pids cgroup enforces it (default: {d.processes})")


def _serve_isolation(group: argparse._ArgumentGroup) -> None:
    """``serve``'s isolation profile."""
    group.add_argument("--profile", choices=["default", "hardened"], default="default", metavar="PROFILE",
                       help="isolation profile, default or hardened (default: default). default: rlimits, "
                       "subreaper, whole-tree kill. hardened: each call also in its own PID, mount and network "
                       "namespaces, read-only filesystem, another uid, no capabilities, seccomp, Landlock, cgroup "
                       "limits; needs root; runs the selfcheck first and refuses to serve if any layer fails")
    group.add_argument("--allow-degraded", action="store_true",
                       help="with --profile hardened: serve even if the machine lacks a layer or the selfcheck "
                       "fails (loudly; tools are then less confined)")
    group.add_argument("--workspace-rw", action="store_true",
                       help="with --profile hardened: tools may write the workspace, acting as its owner there "
                       "(default: read-only). Each call's writes go to a private layer capped at "
                       "--workspace-quota and are copied into the workspace once the call has answered, before "
                       "its result is sent; a call that times out, crashes or is killed first changes nothing, "
                       "and one whose changes would take the workspace over the quota gets an output_limit "
                       "error and changes nothing")
    group.add_argument("--workspace-quota", type=_positive(int), default=1024, metavar="MB",
                       help="with --profile hardened --workspace-rw: the most the workspace may hold after a "
                       "call, in MiB (each file counted at its full size, at least 4 KiB); a call may also "
                       "write at most this much, held in memory (counted against --memory-mb) until it ends "
                       "(default: 1024)")
    group.add_argument("--skip-selfcheck", action="store_true", help=argparse.SUPPRESS)


def _serve_exposure(group: argparse._ArgumentGroup) -> None:
    """``serve``'s keys, and who may reach it."""
    group.add_argument("--curve-secret", metavar="FILE",
                       help="CurveZMQ: encrypt every connection with this server key (a .key_secret file "
                       "from `ciayn-executor keygen`)")
    group.add_argument("--curve-clients", metavar="DIR",
                       help="CurveZMQ: accept only clients whose public key file is in DIR (needs --curve-secret)")
    group.add_argument("--insecure", action="store_true",
                       help="serve on an endpoint other local users (or the network) can reach: tcp without "
                       "CurveZMQ, an abstract ipc socket, or an ipc path outside a 0700 directory of this user. "
                       "Anyone who connects can run the tools as this user; logs a warning")
    group.add_argument("--curve-server-key", metavar="FILE",
                       help="with --connect: the broker's public key file; --curve-secret is then this executor's "
                       "own key pair, whose public key the broker must admit (its --curve-executors DIR)")


def _add_selfcheck_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    check = sub.add_parser("selfcheck", help="attack the hardened profile from inside a real worker",
                           description="Start a hardened executor whose tools are escape attempts (ptrace, "
                           "/proc/PID/mem, signals, cgroup moves, network, secrets, writes, remounts, setuid, "
                           "fork and memory bombs, ...), run each, and print layer, attempt, expected and "
                           "observed. Exit 0 only if every attempt was denied; 2 if the machine lacks a layer.")
    check.add_argument("--profile", choices=["hardened"], default="hardened", metavar="PROFILE",
                       help="the profile to check (default: hardened, the only one)")
    check.add_argument("--json", action="store_true", help="print the rows as JSON (for CI)")
    check.add_argument("--verbose", action="store_true", help="show the executor's log")
    check.add_argument("--workspace-rw", action="store_true",
                       help="check the --workspace-rw variant (the workspace written as its owner, each call's "
                       "writes applied within a 16 MiB --workspace-quota, filling the disk through it tried)")


def _add_keygen_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keygen = sub.add_parser("keygen", help="write a CurveZMQ key pair (NAME.key, NAME.key_secret) into DIR",
                            description="Write a CurveZMQ key pair for an executor or a client: DIR/NAME.key is "
                            "the public key (give it to the other side), DIR/NAME.key_secret the secret one "
                            "(mode 0600).")
    keygen.add_argument("dir", metavar="DIR")
    keygen.add_argument("name", metavar="NAME")


BROKER_DESCRIPTION = """\
Run a broker in front of a pool of executors. Controllers connect to the frontend exactly as to one
executor (ciayn --executor FRONTEND); executors join with `ciayn-executor serve --connect BACKEND`.
Each call goes to an executor that has the tool and a free worker, least loaded first; clients are
served round-robin; an executor that dies or falls silent has its calls answered (or, for idempotent
tools, re-run once elsewhere), and a call its executor has not answered by its timeout plus 2 s is
answered `timeout` by the broker, whatever the executor announced. On tcp, use CurveZMQ:
--curve-secret is the broker's key pair, used on both sockets; --curve-clients and --curve-executors
name the directories of public keys admitted on each.
"""

BROKER_EPILOG = """\
examples:
  ciayn-executor broker --frontend ipc:///run/ciayn/pool.sock --backend ipc:///run/ciayn/pool-backend.sock
  ciayn-executor broker --frontend tcp://0.0.0.0:5555 --backend tcp://0.0.0.0:5556 \\
      --curve-secret keys/broker.key_secret --curve-clients keys/clients --curve-executors keys/executors
"""


def _add_broker_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from protocol.messages import BROKER_CAPACITY, MAX_CAPACITY
    from protocol.timing import APPLY_GRACE, RECOVERY_WINDOW

    broker = sub.add_parser("broker", help="front a pool of executors for many controllers",
                            description=BROKER_DESCRIPTION, epilog=BROKER_EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    broker.add_argument("--frontend", required=True, metavar="ENDPOINT", help="endpoint controllers connect to")
    broker.add_argument("--backend", required=True, metavar="ENDPOINT", help="endpoint executors connect to")
    broker.add_argument("--curve-secret", metavar="FILE", help="CurveZMQ: the broker's .key_secret file")
    broker.add_argument("--curve-clients", metavar="DIR",
                        help="CurveZMQ: admit on the frontend only controllers whose public key is in DIR")
    broker.add_argument("--curve-executors", metavar="DIR",
                        help="CurveZMQ: admit on the backend only executors whose public key is in DIR (required "
                        "with --curve-secret: an executor sees every call it is sent and answers it)")
    broker.add_argument("--max-queue", metavar="N", type=_positive(int), default=65536,
                        help="calls waiting in the broker before new ones are refused (default: 65536)")
    broker.add_argument("--max-queue-mb", metavar="MB", type=_positive(int), default=1024,
                        help="encoded calls waiting in the broker before new ones are refused, a quarter of it "
                        "for any one client (default: 1024)")
    broker.add_argument("--result-cache-mb", metavar="MB", type=_positive(int), default=128,
                        help="encoded results kept to answer a resent call id, fair per client: when full, the "
                        "oldest result of the client holding the most goes first (default: 128)")
    broker.add_argument("--recovery-s", metavar="S", type=float, default=RECOVERY_WINDOW,
                        help="after start, seconds to wait for the executors of a previous run to re-announce "
                        "the calls they hold before sending calls elsewhere, staying silent to clients so that "
                        "they resend theirs (the default matches the client's timing; less breaks that); 0 for "
                        f"a pool that never ran (default: {RECOVERY_WINDOW:g})")
    broker.add_argument("--apply-grace", type=float, default=APPLY_GRACE, metavar="S",
                        help="the most a call's answer may come after its timeout (plus 2 s) because its executor "
                        "is applying its workspace writes (hardened --workspace-rw), granted only to a call the "
                        "executor says it is applying, and at most what the executor announced; it also bounds the "
                        "apply grace the broker's welcome tells clients, whatever an executor announces; 0 to 86400 "
                        f"(default: {APPLY_GRACE:g}, the executor's own)")
    broker.add_argument("--max-executor-capacity", type=_positive(int), default=BROKER_CAPACITY, metavar="N",
                        help="calls sent to one executor at once, at most, whatever workers it announces: a lying "
                        "executor cannot draw every call to itself; at most "
                        f"{MAX_CAPACITY} (default: {BROKER_CAPACITY})")
    broker.add_argument("--max-timeout", type=_positive(float), default=None, metavar="S",
                        help="the longest any call may run in the pool, seconds: a ceiling on every timeout, whether "
                        "the call, its tool or an executor's default set it (an executor's announced default is "
                        "trusted only up to it); a call asking for more is sent to its executor with this timeout. "
                        f"Reported in hello and status (default: {MAX_TIMEOUT_S:g}, a day)")
    broker.add_argument("--metrics-port", metavar="[HOST:]PORT",
                        help="serve Prometheus metrics over HTTP on this port (127.0.0.1 unless HOST is given)")
    broker.add_argument("--state-dir", metavar="DIR",
                        help="keep a journal of which executor each call was sent to in DIR, so that after a restart "
                        "the broker does not run a resent call again when the executor that had it did not come "
                        "back (it answers `unavailable`, may have run); without it, that double fault can run a "
                        "call twice")
    broker.add_argument("--insecure", action="store_true",
                        help="allow tcp without CurveZMQ (anyone who can reach an endpoint can use it) and abstract "
                        "ipc sockets")
    _log_options(broker)


def _add_status_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = sub.add_parser("status", help="show what a broker or an executor is doing",
                            description="Ask a broker (or a single executor) for its executors, tools, "
                            "capacity, queue depth, calls served, worker restarts and per-tool latency.")
    status.add_argument("endpoint", metavar="ENDPOINT", help="the broker's frontend, or an executor's endpoint")
    status.add_argument("--json", action="store_true", help="print the report as JSON")
    status.add_argument("--timeout", metavar="S", type=_positive(float), default=5.0,
                        help="seconds to wait for an answer (default: 5)")
    status.add_argument("--curve-server-key", metavar="FILE", help="CurveZMQ: the server's public key file")
    status.add_argument("--curve-key", metavar="FILE", help="CurveZMQ: this client's .key_secret file")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    level = getattr(args, "log_level", None) or ("debug" if getattr(args, "verbose", 0) else "info")
    logging.basicConfig(stream=sys.stderr, level=level.upper(),
                        format=f"%(asctime)s ciayn-executor[{os.getpid()}] %(levelname)s %(message)s")
    if args.command == "serve":
        return _serve(args)
    if args.command == "broker":
        return _broker(args)
    if args.command == "status":
        return _status(args)
    if args.command == "selfcheck":
        from executor.sandbox import selfcheck

        return selfcheck.main(as_json=args.json, quiet=not args.verbose, workspace_rw=args.workspace_rw)
    if args.command == "keygen":
        from protocol.curve import CurveError, keygen

        try:
            public, secret = keygen(args.dir, args.name)
        except (CurveError, OSError) as e:
            print(f"ciayn-executor: {e}", file=sys.stderr)
            return 1
        print(f"public key: {public}\nsecret key: {secret} (keep it private)")
        return 0
    return 2


def _timeouts_disagree(timeout: float | None, max_timeout: float | None) -> str:
    """Why a --timeout and a --max-timeout cannot both hold (a default over its ceiling), or ""."""
    for flag, value in (("--timeout", timeout), ("--max-timeout", max_timeout)):
        if value is not None and value > MAX_TIMEOUT_S:
            return f"{flag} must be at most {MAX_TIMEOUT_S:g} seconds (a day), got {value:g}"
    if timeout is not None and max_timeout is not None and timeout > max_timeout:
        return (f"--timeout {timeout:g} is over --max-timeout {max_timeout:g}: the default of a call cannot be "
                "longer than the longest any call may run")
    return ""


def _serve(args: argparse.Namespace) -> int:
    if args.workspace and not os.path.isdir(args.workspace):
        print(f"ciayn-executor: workspace {args.workspace!r} is not a directory", file=sys.stderr)
        return 2
    if args.curve_clients and not args.curve_secret:
        print("ciayn-executor: --curve-clients needs --curve-secret (the server's own key)", file=sys.stderr)
        return 2
    if args.connect and args.curve_clients:
        print("ciayn-executor: --curve-clients is for --bind; with --connect the broker admits clients",
              file=sys.stderr)
        return 2
    if args.curve_server_key and not args.connect:
        print("ciayn-executor: --curve-server-key is for --connect (the broker's public key)", file=sys.stderr)
        return 2
    if args.connect and args.curve_secret and not args.curve_server_key:
        print("ciayn-executor: with --connect, --curve-secret needs --curve-server-key (the broker's public key)",
              file=sys.stderr)
        return 2
    if bad := _timeouts_disagree(args.timeout, args.max_timeout):
        print(f"ciayn-executor: {bad}", file=sys.stderr)
        return 2
    try:
        check_pass_env(args.pass_env)
    except ValueError as e:
        print(f"ciayn-executor: {e}", file=sys.stderr)
        return 2
    # Never hold a secret a tool is not handed: start again with the allowlisted environment only.
    reexec_without_secrets(args.pass_env)
    # File paths of tool modules are relative to where the command ran, not to --workspace (the
    # executor changes into the workspace before it imports them).
    args.tools = [os.path.abspath(t) if t.endswith(".py") or os.sep in t else t for t in args.tools]
    args.workspace = os.path.abspath(args.workspace) if args.workspace else None
    if args.profile == "hardened":
        from executor.sandbox.start import start_hardened

        if code := start_hardened(args):  # refuses, or runs the selfcheck and builds the profile
            return code
    max_timeout = args.max_timeout or MAX_TIMEOUT_S
    limits = Limits(timeout_s=args.timeout or min(Limits().timeout_s, max_timeout), cpu_s=args.cpu_s,
                    memory_mb=args.memory_mb, max_output_kb=args.max_output_kb, max_result_kb=args.max_result_kb,
                    processes=args.max_processes)
    from executor.supervisor import ServeConfig, StartupError, Supervisor

    config = ServeConfig(
        tools=args.tools, endpoint=args.connect or args.bind, limits=limits, max_timeout=max_timeout,
        workers=args.workers, max_queue=args.max_queue, max_queue_mb=args.max_queue_mb,
        max_queue_wait=args.max_queue_wait, workspace=args.workspace, parent_pid=args.parent_pid,
        profile=args.profile, use_cgroups=not args.no_cgroups, reuse_workers=args.reuse_workers,
        pass_env=tuple(args.pass_env or ()), connect=bool(args.connect), curve_secret=args.curve_secret,
        curve_clients=args.curve_clients, curve_server_key=args.curve_server_key, insecure=args.insecure,
        metrics=args.metrics_port, confinement=getattr(args, "confinement", None),
    )
    supervisor = Supervisor(config)
    try:
        return supervisor.serve()
    except StartupError as e:
        print(f"ciayn-executor: cannot start: {e}", file=sys.stderr)
        return 1


def _broker(args: argparse.Namespace) -> int:
    from executor.broker import Broker, BrokerError
    from protocol.messages import MAX_CAPACITY

    if (args.curve_clients or args.curve_executors) and not args.curve_secret:
        print("ciayn-executor: --curve-clients and --curve-executors need --curve-secret (the broker's own key)",
              file=sys.stderr)
        return 2
    if not 0 <= args.recovery_s < 3600:
        print(f"ciayn-executor: --recovery-s must be between 0 and 3600 seconds, got {args.recovery_s}",
              file=sys.stderr)
        return 2
    if not 0 <= args.apply_grace <= MAX_TIMEOUT_S:
        print(f"ciayn-executor: --apply-grace must be between 0 and {MAX_TIMEOUT_S:g} seconds, got {args.apply_grace}",
              file=sys.stderr)
        return 2
    if bad := _timeouts_disagree(None, args.max_timeout):
        print(f"ciayn-executor: {bad}", file=sys.stderr)
        return 2
    if args.max_executor_capacity > MAX_CAPACITY:
        print(f"ciayn-executor: --max-executor-capacity must be at most {MAX_CAPACITY} (what a `ready` may announce), "
              f"got {args.max_executor_capacity}", file=sys.stderr)
        return 2
    broker = Broker(args.frontend, args.backend, curve_secret=args.curve_secret, curve_clients=args.curve_clients,
                    curve_executors=args.curve_executors, max_queue=args.max_queue, recovery_s=args.recovery_s,
                    max_queue_bytes=args.max_queue_mb * 1024**2, cache_bytes=args.result_cache_mb * 1024**2,
                    metrics=args.metrics_port, insecure=args.insecure, state_dir=args.state_dir,
                    apply_grace=args.apply_grace, max_executor_capacity=args.max_executor_capacity,
                    max_timeout=args.max_timeout or MAX_TIMEOUT_S)
    try:
        return broker.serve()
    except BrokerError as e:
        print(f"ciayn-executor: cannot start the broker: {e}", file=sys.stderr)
        return 1


def _status(args: argparse.Namespace) -> int:
    from executor.status import StatusError, as_json, fetch, render
    from protocol.curve import CurveError, load_pair, load_public

    try:
        server_key = load_public(args.curve_server_key) if args.curve_server_key else None
        keys = load_pair(args.curve_key) if args.curve_key else None
        report = fetch(args.endpoint, timeout=args.timeout, curve_server_key=server_key, curve_keys=keys)
    except (StatusError, CurveError) as e:
        print(f"ciayn-executor: {e}", file=sys.stderr)
        return 1
    print(as_json(report) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
