"""Agent frameworks against the server, on random weights: a LangChain agent loop (``bind_tools``, the tool run,
its result sent back), LangChain's ``with_structured_output`` by function calling, and LiteLLM's tool calls.
Forced choices (``required``, a named tool) so the call always comes."""

from __future__ import annotations

import os
from typing import Literal

import pytest
from pydantic import BaseModel, Field
from sluice.app.server.app import build_app
from sluice.core import AsyncEngine, EngineArgs

from tests.server_helpers import ServerThread

KEY = "agents-key"


class Forecast(BaseModel):
    """The forecast to look up."""

    unit: Literal["c", "f"]
    days: int = Field(ge=1, le=9)
    hourly: bool


@pytest.fixture(scope="module")
def server():
    args = EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=512, max_model_len=2048, max_num_seqs=4)
    srv = ServerThread(build_app(AsyncEngine(args), api_key=KEY)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def chat_model(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="dummy:tiny", base_url=server.url + "/v1", api_key=KEY, max_tokens=60, max_retries=0, seed=7
    )


def test_langchain_agent_loop_with_bind_tools(chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    ran = []

    @tool(args_schema=Forecast)
    def forecast(unit: str, days: int, hourly: bool) -> str:
        """Look up the forecast."""
        ran.append((unit, days, hourly))
        return f"sunny for {days} days"

    messages = [HumanMessage("Forecast for Oslo?")]
    ai = chat_model.bind_tools([forecast], tool_choice="required", parallel_tool_calls=False).invoke(messages)
    assert ai.tool_calls and all(c["name"] == "forecast" for c in ai.tool_calls)
    messages.append(ai)
    for call in ai.tool_calls:
        Forecast.model_validate(call["args"])
        messages.append(ToolMessage(forecast.invoke(call["args"]), tool_call_id=call["id"]))
    assert len(ran) == len(ai.tool_calls)
    answer = chat_model.bind_tools([forecast], tool_choice="none").bind(max_tokens=4).invoke(messages)
    assert isinstance(answer.content, str) and not answer.tool_calls


def test_langchain_with_structured_output_by_function_calling(chat_model):
    structured = chat_model.with_structured_output(Forecast, method="function_calling")
    assert isinstance(structured.invoke("Forecast for Oslo?"), Forecast)


def test_litellm_tool_calls(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
    import litellm

    tools = [{"type": "function", "function": {"name": "forecast", "parameters": Forecast.model_json_schema()}}]
    r = litellm.completion(
        model="openai/dummy:tiny",
        api_base=server.url + "/v1",
        api_key=KEY,
        messages=[{"role": "user", "content": "Forecast for Oslo?"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "forecast"}},
        parallel_tool_calls=False,
        max_tokens=60,
        seed=3,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    for call in choice.message.tool_calls:
        assert call.function.name == "forecast"
        Forecast.model_validate_json(call.function.arguments)
