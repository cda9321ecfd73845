"""Fill a pydantic schema with ChatPagedLLM.with_structured_output, offline.

    python examples/structured_output.py
    python examples/structured_output.py --method function_calling

The engine constrains decoding token by token, so the model can only write JSON that
fits the schema (method="json_schema"), any JSON object ("json_mode"), or a forced call of
a tool made from the schema ("function_calling"). Whatever a 135M model lacks in skill,
the output always parses.
"""

from __future__ import annotations

import argparse
import sys
from typing import Literal

from pydantic import BaseModel, Field


class BikeOrder(BaseModel):
    """An order taken from a customer's message."""

    customer: str = Field(description="the customer's first name")
    bike_type: Literal["city", "mountain", "electric"] = Field(description="the kind of bike")
    days: int = Field(description="how many days the rental lasts")


MESSAGES = [
    "Hi, this is Tom. I would like to rent an electric bike for 3 days.",
    "My name is Ana and I need a mountain bike for 2 days next week.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--method", default="json_schema", choices=["json_schema", "function_calling"]
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    args = parser.parse_args(argv)

    from pagedllm_integrations.langchain import ChatPagedLLM

    chat = ChatPagedLLM(
        model=args.model,
        temperature=0,
        max_tokens=args.max_tokens,
        repetition_penalty=1.1,  # a 135M model loops inside JSON strings without it
        engine_kwargs={"max_model_len": 2048},
    )
    extractor = chat.with_structured_output(BikeOrder, method=args.method, include_raw=True)
    for text in MESSAGES:
        result = extractor.invoke(f"Extract the rental order from this message: {text}")
        print(f"\nmessage: {text}")
        if result["parsed"] is None:
            print(f"  could not parse ({result['parsing_error']}); raw: {result['raw'].content!r}")
            continue
        print(f"  order:   {result['parsed']!r}")
        print(f"  as JSON: {result['parsed'].model_dump_json()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
