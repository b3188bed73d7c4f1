"""The agent benchmarks/agents_sdk_run.py runs (under a Python with openai-agents): argv = server /v1 URL, model.

Exits non-zero unless both runs (Runner.run and Runner.run_streamed) called the tool and finished with text.
"""

from __future__ import annotations

import asyncio
import sys
import time

from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

CALLS: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city.

    Args:
        city: the city's name.
    """
    CALLS.append(city)
    return f"The weather in {city} is 18 C and sunny."


def report(kind: str, result, seconds: float, calls: list[str]) -> bool:
    items = [item.type for item in result.new_items]
    print(f"{kind}: {seconds:.1f} s, tool calls {calls}, items {items}")
    print(f"  final output: {result.final_output!r}")
    return bool(calls) and "tool_call_output_item" in items and isinstance(result.final_output, str) \
        and bool(result.final_output.strip())


async def main(base_url: str, model: str) -> int:
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key="none"), use_for_tracing=False)
    set_default_openai_api("responses")  # the SDK's default model: OpenAIResponsesModel
    set_tracing_disabled(True)
    agent = Agent(name="weather", instructions="You answer questions about the weather. Use the tools.",
                  tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=64,
                                               parallel_tool_calls=False))
    question = "What is the weather in Paris?"
    ok = True
    start = time.perf_counter()
    result = await Runner.run(agent, question, max_turns=4)
    ok &= report("Runner.run", result, time.perf_counter() - start, list(CALLS))
    CALLS.clear()
    start = time.perf_counter()
    streamed = Runner.run_streamed(agent, question, max_turns=4)
    deltas = 0
    async for event in streamed.stream_events():
        if event.type == "raw_response_event" and getattr(event.data, "type", "") == "response.output_text.delta":
            deltas += 1
    ok &= report("Runner.run_streamed", streamed, time.perf_counter() - start, list(CALLS))
    print(f"  text deltas streamed: {deltas}")
    print("both runs called the tool and answered" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2])))
