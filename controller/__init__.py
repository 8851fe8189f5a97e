"""The controller side of ciayn-sandbox: the executor client, the agent backends and the CLI.

Heavy dependencies (litellm, langgraph) are imported lazily, only by the code paths that talk to a
model, so ``import controller`` and the executor client stay fast.
"""

from controller.client import ExecutorClient, ExecutorUnavailable
from controller.local import ExecutorStartError, LocalExecutor

__all__ = ["ExecutorClient", "ExecutorStartError", "ExecutorUnavailable", "LocalExecutor"]
