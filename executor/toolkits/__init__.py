"""Tool modules that ship with ciayn-sandbox; load one with ``ciayn-executor serve --tools MODULE``.

- ``executor.toolkits.builtin`` (the default): read/write/list files confined to the workspace, note
  and complete.
- ``executor.toolkits.shell``: ``run_shell``, full shell access as the executor's user; not confined
  to the workspace, so serve it under ``--profile hardened`` when a model chooses the commands.
"""
