"""What tests share: real pools (``pool``), waiting on conditions with a bound (``waiting``), free ports
(``net``), process checks (``processes``), the executor behind a client (``executors``), raw sockets on an
executor (``wire``), hostile peers (``hostile``), an executor process started by hand (``serve``),
bodies built to cost a decoder work (``bombs``), the fault table and its judge (``faults``), the attack
suite's executor (``attacks``), a hardened executor with a workspace quota (``quota``) and the mark for
tests of the embedded model (``embedded_model``). Fixtures stay in ``tests/conftest.py``, but for those
that come with ``serve``'s and ``attacks``' executors, which their users import by name; a helper
written once lives here, never in a test module for others to import."""
