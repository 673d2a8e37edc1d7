"""Tool calling for the chat endpoint: a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` become a
`ToolPlan` (`plan.py`): the tools checked, and a grammar (`grammar.py`) that holds the model to the Hermes call
layout (`sluice.core.frontend.hermes_tools`) with each call's arguments valid for its tool's schema. The text the
model writes is read back by `ToolCallParser` (`call_parser.py`), an incremental reader of that same fixed layout,
and `ToolCallStream` (`stream.py`) turns its events into OpenAI's ``delta.tool_calls`` fragments; a non-streamed
answer is the same parser run over the whole text, so streamed and non-streamed calls are the same calls."""

from sluice.app.server.tools.call_parser import ParsedTurn, ToolCallParser
from sluice.app.server.tools.plan import ToolPlan, plan_tools

__all__ = ["ParsedTurn", "ToolCallParser", "ToolPlan", "plan_tools"]
