"""What tests share: real pools (``pool``), waiting on conditions with a bound (``waiting``), free ports
(``net``), process checks (``processes``), the executor behind a client (``executors``), raw sockets on an
executor (``wire``), hostile peers (``hostile``), an executor process started by hand (``serve``) and
bodies built to cost a decoder work (``bombs``). Fixtures stay in ``tests/conftest.py``, but for the two
that come with ``serve``'s executors, which its users import by name; a helper written once lives here,
never in a test module for others to import."""
