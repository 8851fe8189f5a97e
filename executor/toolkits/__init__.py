"""Tool modules that ship with ciayn-sandbox; load one with ``ciayn-executor serve --tools MODULE``.

- ``executor.toolkits.builtin``: read/write/list files in the workspace, a shell, note and complete.
"""
