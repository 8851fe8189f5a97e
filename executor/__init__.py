"""The executor side of ciayn-sandbox: holds the tools and runs each call in a supervised worker.

Tool authors need only this:

    from executor import tool, signals, workspace

    @tool(no_repeat=True, timeout=10)
    def read_file(path: str) -> str:
        \"\"\"Read a UTF-8 text file from the workspace.\"\"\"

This package never imports the controller, litellm, langchain or langgraph.
"""

from executor import signals
from executor.context import workspace
from executor.registry import RegistryError, Tool, load_tools, tool
from executor.toolkits.paths import confine

__all__ = ["RegistryError", "Tool", "confine", "load_tools", "signals", "tool", "workspace"]
