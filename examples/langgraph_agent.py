"""The same math agent as a LangGraph graph (``pip install langgraph langchain-openai``): the tutorial's
agent/tools loop (``StateGraph`` + ``ToolNode`` + ``tools_condition``) with a ``ChatOpenAI`` model. It trains with
fleetrl unchanged (``env.agent: examples.langgraph_agent:solve``): fleetrl only supplies the ``openai`` client that
``ChatOpenAI`` talks through; LangChain writes the requests, parses the tool calls and echoes the history back.

    python -m examples.langgraph_agent --base-url http://127.0.0.1:8000/v1 --model M [--n 20]   # any server
"""

from __future__ import annotations

from examples.math_agent import SYSTEM, correct
from examples.math_agent import calculator as _calculator
from examples.math_agent import python as _python


def build_graph(llm):
    """agent -> (tools -> agent)* until a reply without a tool call."""
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return _calculator(expression)

    @tool
    def python(code: str) -> str:
        """Run a Python program; returns its stdout."""
        return _python(code)

    tools = [calculator, python]
    model = llm.bind_tools(tools)

    async def agent(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools, handle_tool_errors=True))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


async def solve(client, task: dict, model: str = "policy", max_turns: int = 3, transcript: list | None = None,
                temperature: float | None = None) -> float:
    """The graph on one task through ``client`` (an ``openai.AsyncOpenAI``); 1.0 when the last reply's last number
    is the answer, 0.0 when it is not or the model still calls tools after ``max_turns`` replies (``transcript``,
    when given, gets the conversation's messages in the OpenAI format)."""
    from langchain_core.messages import HumanMessage, SystemMessage, convert_to_openai_messages
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError

    llm = ChatOpenAI(model=model, api_key=client.api_key, base_url=str(client.base_url), max_tokens=64,
                     temperature=temperature, max_retries=0, root_async_client=client,
                     async_client=client.chat.completions)
    try:
        state = await build_graph(llm).ainvoke(
            {"messages": [SystemMessage(SYSTEM), HumanMessage(task["prompt"])]},
            {"recursion_limit": 2 * max_turns - 1})  # agent, tools, ..., agent: max_turns model calls
    except GraphRecursionError:
        return 0.0
    if transcript is not None:
        transcript += convert_to_openai_messages(state["messages"])
    return float(correct(state["messages"][-1].content, task["answer"]))


if __name__ == "__main__":
    from examples.math_agent import evaluate

    evaluate(solve, __doc__.splitlines()[0], temperature=0.0)  # greedy: an evaluation
