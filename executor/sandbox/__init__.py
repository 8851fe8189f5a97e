"""The hardened profile (``serve --profile hardened``), one module per kernel concern, like nsjail.

``kernel`` (the C library, syscall numbers, constants, ``LayerError``) is at the bottom; above it
``identity``, ``seccomp``, ``landlock``, ``cpu``, ``overlay`` and ``mounts``, composed by ``layers``
(the ``Layer`` table) into ``profile`` (``HardenedConfig`` is in ``config``; ``Sandbox``, the
``Confinement`` the template is given). ``keeper`` is a ``--workspace-rw`` worker's process outside
its sandbox. ``attempts`` are the selfcheck's escape attempts (tools run in a hardened worker),
``selfcheck`` their judge on the host, ``start`` the gate of ``serve --profile hardened``. Nothing
here is re-exported: import the module you need. Nothing here but ``selfcheck`` speaks ZeroMQ.
"""
