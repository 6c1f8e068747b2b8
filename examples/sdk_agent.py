"""The same math agent written with the OpenAI Agents SDK (``pip install openai-agents``) instead of a hand-written
loop: an agent framework's code trains with fleetrl unchanged (``env.agent: examples.sdk_agent:solve``). The SDK
runs the tool loop; fleetrl only supplies the ``openai`` client its model talks through.
"""

from __future__ import annotations

from examples.math_agent import SYSTEM, correct
from examples.math_agent import calculator as _calculator
from examples.math_agent import python as _python


async def solve(client, task: dict, model: str = "policy") -> float:
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # the SDK would send traces to OpenAI's servers

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return _calculator(expression)

    @function_tool
    def python(code: str) -> str:
        """Run a Python program; returns its stdout."""
        return _python(code)

    agent = Agent(name="math", instructions=SYSTEM, tools=[calculator, python],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  model_settings=ModelSettings(max_tokens=64))
    try:
        result = await Runner.run(agent, task["prompt"], max_turns=3)
    except MaxTurnsExceeded:
        return 0.0
    return float(correct(str(result.final_output), task["answer"]))
