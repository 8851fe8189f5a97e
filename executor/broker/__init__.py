"""The broker (``ciayn-executor broker``): one endpoint in front of a pool of executors, for many
controllers, which talk to it as to one executor while executors join it with ``serve --connect``.
``Broker`` (``broker``) composes its parts: ``sockets`` (the two bound ROUTERs), ``members`` (who
is connected, and the claims on their ids), ``routing`` (which member runs a call, sending, re-runs,
deadlines), ``answers`` (the calls accepted and the at-most-once memory it shares with the
executor) and ``journal`` (where calls were sent, across restarts); ``records`` are the call and
member records they share. How the pool behaves and why is in docs/pool.md; the wire rules are in
protocol/SPEC.md section 12.
"""

from executor.broker.broker import Broker
from executor.broker.sockets import BrokerError

__all__ = ["Broker", "BrokerError"]
