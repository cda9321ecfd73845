"""Render one chat template a client sent, in a process of its own (see template_sandbox.py).

Run as `python -I template_worker.py`: the job comes as JSON on stdin ({"template",
"context", "max_chars", "cpu_seconds", "memory_bytes"}), the answer goes to stdout
({"text"} or {"error"}). Only the standard library and jinja2 are imported; the process
limits its own CPU time and address space before it reads a byte of the template, and
renders in jinja2's immutable sandbox with the helpers chat templates expect (the same
environment transformers gives a tokenizer's own template).
"""

import json
import resource
import sys
from datetime import datetime


def _limit(cpu_seconds: int, memory_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # it writes no files
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # and starts no processes


def _environment():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): the text only."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            node = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
            return node.set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def main() -> int:
    job = json.loads(sys.stdin.read())
    _limit(int(job["cpu_seconds"]), int(job["memory_bytes"]))
    max_chars = int(job["max_chars"])
    try:
        template = _environment().from_string(job["template"])
        pieces, size = [], 0
        for piece in template.generate(**job["context"]):
            size += len(piece)
            if size > max_chars:
                raise ValueError(f"the rendered prompt passed {max_chars} characters")
            pieces.append(piece)
        answer = {"text": "".join(pieces)}
    except MemoryError:
        answer = {"error": "the template used more memory than allowed"}
    except RecursionError:
        answer = {"error": "the template recursed too deeply"}
    except Exception as error:  # the template's own fault: its message, shortened
        answer = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
    sys.stdout.write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
