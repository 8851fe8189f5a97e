"""CurveZMQ on tcp: key files and the server side of the handshake, for executors and brokers.

``ciayn-executor keygen DIR NAME`` writes ``DIR/NAME.key`` (public, give it to the other side) and
``DIR/NAME.key_secret`` (keep it private, mode 0600), in ZeroMQ's certificate format. An executor
started with ``--curve-secret server.key_secret`` encrypts every connection; with
``--curve-clients DIR`` as well, only clients whose public key file is in ``DIR`` may connect.
Clients pass the server's public key (``ExecutorClient(curve_server_key=...)``, ``ciayn
--curve-server-key FILE``) and, for an authenticated executor, their own key pair. A broker is a
server twice (for controllers and for executors), each socket in its own ZeroMQ context, since one
context has one authenticator and one policy.

It lives in ``protocol`` because both sides load keys; ``import protocol`` does not import it (nor
ZeroMQ).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from protocol.errors import CiaynError


class CurveError(CiaynError):
    """A key file that is missing, unreadable or of the wrong kind; the message says which."""


def keygen(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write a key pair; return (public file, secret file). Refuses to overwrite an existing pair."""
    if not name or "/" in name or name.startswith("."):
        raise CurveError(f"key name {name!r} must be a plain file name")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = d / f"{name}.key", d / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise CurveError(f"{public} or {secret} already exists; remove it or choose another name")
    old_umask = os.umask(0o077)
    try:
        made_public, made_secret = zmq.auth.create_certificates(str(d), name)
    finally:
        os.umask(old_umask)
    os.chmod(made_public, 0o644)
    return Path(made_public), Path(made_secret)


def load_public(path: str | os.PathLike[str]) -> bytes:
    """The public key in a key file (public or secret file)."""
    public, _ = _load(path)
    return public


def load_pair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file."""
    public, secret = _load(path)
    if secret is None:
        raise CurveError(f"{path} holds no secret key; pass the .key_secret file")
    return public, secret


def _load(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise CurveError(f"cannot read the CurveZMQ key file {path}: {e}") from None


def secure_server(ctx: zmq.Context[Any], sock: zmq.Socket[Any], secret_file: str,
                  clients_dir: str | None) -> ThreadAuthenticator:
    """Make ``sock`` a CURVE server; with ``clients_dir``, accept only the keys found there."""
    public, secret = load_pair(secret_file)
    if clients_dir is not None and not Path(clients_dir).is_dir():
        raise CurveError(f"--curve-clients {clients_dir} is not a directory of client public keys")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=clients_dir if clients_dir else zmq.auth.CURVE_ALLOW_ANY)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def secure_client(sock: zmq.Socket[Any], server_public: bytes, keys: tuple[bytes, bytes] | None = None) -> None:
    """Make ``sock`` a CURVE client of the server with public key ``server_public``, with the key
    pair ``keys`` (public, secret), or a throwaway pair for a server that admits any client key."""
    public, secret = keys or zmq.curve_keypair()
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret
