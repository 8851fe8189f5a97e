"""The controller side of ciayn-sandbox: the executor client, the agent backends and the CLI.

Heavy dependencies (litellm, langgraph) are imported lazily, only by the code paths that talk to a
model, so ``import controller`` and the executor client stay fast.
"""

from controller.agent import Agent, create_agent
from controller.backend import choose_backend, should_use_react_agent
from controller.client import ExecutorClient, ExecutorUnavailable
from controller.local import ExecutorStartError, LocalExecutor
from controller.toolclient import ToolClient
from protocol.errors import CiaynError

__all__ = [
    "Agent",
    "CiaynError",
    "ExecutorClient",
    "ExecutorStartError",
    "ExecutorUnavailable",
    "LocalExecutor",
    "ToolClient",
    "choose_backend",
    "create_agent",
    "should_use_react_agent",
]
