"""What tests share: real pools (``pool``), waiting on conditions with a bound (``waiting``), free ports
(``net``), process checks (``processes``) and the executor behind a client (``executors``). Fixtures stay in
``tests/conftest.py``; a helper written once lives here, never in a test module for others to import."""
