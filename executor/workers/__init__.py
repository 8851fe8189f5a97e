"""The far side of the fork: the template process, the workers it forks, and what they need.

Everything here runs in a process that imports tool code, or is one fork away from one: the
template (``template``), the workers it forks (``worker``), their internal wire to
the supervisor (``channel`` messages in ``framing`` frames), how the template is started
(``spawn``), and the kernel-facing helpers they use (``processes``, ``procfs``, ``quickfork``,
``cgroups``, ``pidns``, ``privacy``). It never imports ZeroMQ, asyncio, threading, logging handlers
or the supervisor's modules (``tests/test_import_isolation.py`` checks it): a template that had
them would carry their threads and state into every worker.
"""
