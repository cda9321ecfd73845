"""A LangGraph ReAct agent with two Python tools, on ChatPagedLLM, offline.

    python examples/agent_langchain.py
    python examples/agent_langchain.py --question "How much is renting a city bike for 3 days?"

The agent is LangGraph's prebuilt `create_react_agent` (pip install langgraph). A 135M
model does not decide by itself to call a tool, so on the user's turn the tool call is
forced (tool_choice="any": the engine's constrained decoding makes the model write a
schema-valid call of one of the tools), and after the tool's result it answers in text.
With a larger model, pass --auto to let it choose (tool_choice="auto").
"""

from __future__ import annotations

import argparse
import sys

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

RENTAL_PRICES = {"city": 15, "mountain": 25, "electric": 40}  # euros per day


@tool
def rental_price(bike_type: str, days: int) -> str:
    """Price in euros of renting a bike. bike_type is city, mountain or electric."""
    per_day = RENTAL_PRICES.get(bike_type.lower().split()[0] if bike_type.strip() else "")
    if per_day is None:
        return f"unknown bike type {bike_type!r}; choose city, mountain or electric"
    total = per_day * days
    if days >= 7:
        total = total * 0.8  # weekly rentals: 20 percent off
    return f"{total:g} euros for {days} days"


@tool
def opening_hours(day: str) -> str:
    """Opening hours of the shop on a day of the week."""
    day = day.strip().lower()
    if day.startswith("sun"):
        return "10 am to 4 pm"
    if day[:3] in ("mon", "tue", "wed", "thu", "fri", "sat"):
        return "9 am to 6 pm"
    return f"unknown day {day!r}"


QUESTIONS = [
    "How much does it cost to rent a mountain bike for 3 days?",
    "When is the shop open on Sunday?",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--question", action="append", help="ask this (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--auto", action="store_true", help="let the model choose (tool_choice=auto)"
    )
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    args = parser.parse_args(argv)
    try:
        import warnings

        from langgraph.prebuilt import create_react_agent

        # LangGraph 1.x points to langchain.agents.create_agent; the prebuilt agent stays
        # until LangGraph 2 and needs no extra package.
        warnings.filterwarnings("ignore", message="create_react_agent has been moved")
    except ImportError:
        print("this example needs LangGraph: pip install langgraph", file=sys.stderr)
        return 1

    from pagedllm_integrations.langchain import ChatPagedLLM

    tools = [rental_price, opening_hours]
    chat = ChatPagedLLM(
        model=args.model,
        temperature=0,
        max_tokens=args.max_tokens,
        stop=["\n\n"],
        engine_kwargs={"max_model_len": 2048},
    )

    def model_for(state, runtime):
        if args.auto:
            return chat.bind_tools(tools)
        forced = isinstance(state["messages"][-1], HumanMessage)
        return chat.bind_tools(tools, tool_choice="any" if forced else "none")

    agent = create_react_agent(model_for, tools)
    for question in args.question or QUESTIONS:
        print(f"\nuser: {question}")
        result = agent.invoke({"messages": [HumanMessage(question)]})
        for message in result["messages"][1:]:
            if isinstance(message, AIMessage) and message.tool_calls:
                for call in message.tool_calls:
                    print(f"  model calls {call['name']}({call['args']})")
            elif isinstance(message, ToolMessage):
                print(f"  tool {message.name} returns: {message.content}")
            elif isinstance(message, AIMessage):
                print(f"assistant: {message.content}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
