"""The executor side of ciayn-sandbox: holds the tools and runs each call in a supervised worker.

Tool authors need only this:

    from executor import tool, signals, workspace

    @tool(no_repeat=True, timeout=10)
    def read_file(path: str) -> str:
        \"\"\"Read a UTF-8 text file from the workspace.\"\"\"

Workspace files: ``open_beneath(path, flags)`` opens a path the model gave, resolved by the kernel
beneath the workspace (openat2), so no symlink or swapped directory leads out; ``confine(path)``
only checks a path (a realpath test, which a concurrent swap can beat).

This package never imports the controller, litellm, langchain or langgraph.
"""

from executor import signals
from executor.context import workspace
from executor.registry import RegistryError, Tool, load_tools, tool
from executor.toolkits.paths import confine, open_beneath
from protocol.errors import CiaynError

__all__ = [
    "CiaynError", "RegistryError", "Tool", "confine", "load_tools", "open_beneath", "signals", "tool", "workspace",
]
