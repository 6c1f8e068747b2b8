"""Tools: plain Python callables with a JSON schema and a timeout. ``calculator`` evaluates arithmetic through an
AST whitelist (no ``eval``); ``python`` runs a program in the namespace sandbox (:func:`rewards.sandbox.run_program`),
never in the rollout actor's interpreter. Register your own with :func:`register_tool` or give
``package.module:attr`` (a :class:`Tool`) in ``env.tools``."""

from __future__ import annotations

import ast
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.registry import Registry
from workers.envs.api import call


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., str]
    description: str
    parameters: dict = field(default_factory=dict)  # JSON schema of the keyword arguments
    timeout_s: float = 5.0
    max_output_chars: int = 2000

    def schema(self) -> dict:
        """The OpenAI / hermes function schema chat templates render."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolResult:
    output: str
    error: str | None
    seconds: float


TOOLS = Registry("tool")


def register_tool(tool: Tool) -> Tool:
    TOOLS.register(tool.name)(tool)
    return tool


def load_tool(spec: str) -> Tool:
    obj = TOOLS.resolve(spec, "env.tools")
    if not isinstance(obj, Tool):
        raise ValueError(f"env.tools: {spec!r} is a {type(obj).__name__}, not a workers.envs.tools.Tool")
    return obj


def argument_errors(tool: Tool, arguments: dict) -> str | None:
    """Why ``arguments`` do not fit the tool's JSON schema (missing, ill-typed or unknown-when-forbidden
    arguments), in one line; None when they fit."""
    import jsonschema

    validator = jsonschema.validators.validator_for(tool.parameters)(tool.parameters)
    problems = sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))
    if not problems:
        return None
    said = "; ".join((f"{'.'.join(map(str, e.path))}: " if e.path else "") + e.message for e in problems[:3])
    return f"{tool.name}: bad arguments: {said}"[:500]


async def run_tool(tool: Tool, arguments: dict) -> ToolResult:
    """Run one call in a thread under the tool's timeout. Never raises: arguments that do not fit the tool's JSON
    schema, a timeout or an exception become ``error`` (the tool is not called with bad arguments); the output is
    cut to ``max_output_chars`` (marked)."""
    t0 = time.perf_counter()
    if (error := argument_errors(tool, arguments)) is not None:
        return ToolResult("", error, time.perf_counter() - t0)
    try:
        out = str(await call(tool.fn, timeout_s=tool.timeout_s, **arguments))
        error = None
    except TimeoutError:
        out, error = "", f"{tool.name} timed out after {tool.timeout_s:g}s"
    except Exception as e:  # the tool's own failure is the observation, not the episode's
        out, error = "", f"{tool.name} failed: {type(e).__name__}: {e}"[:500]
    if len(out) > tool.max_output_chars:
        out = out[: tool.max_output_chars] + f"... [cut at {tool.max_output_chars} chars]"
    return ToolResult(out, error, time.perf_counter() - t0)


# ---- calculator -------------------------------------------------------------------------------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT, MAX_DIGITS, MAX_LENGTH = 100, 1000, 200


def calculate(expression: str) -> str:
    """Arithmetic on numbers with ``+ - * / // % **`` and parentheses; integers stay exact (``347*58`` ->
    ``20126``). Anything else (names, calls, attributes, huge powers) is a ValueError."""
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
            raise ValueError(f"result has more than {MAX_DIGITS} digits")
        return value
    raise ValueError(f"not allowed in a calculator expression: {ast.dump(node)[:80]}")


CALCULATOR = register_tool(Tool(
    "calculator", calculate, "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}))


# ---- python -----------------------------------------------------------------------------------------------------
def run_python(code: str) -> str:
    """Run ``code`` in the namespace sandbox (no network, no host files, rlimits); its stdout, and the status when
    it did not exit cleanly."""
    from rewards.sandbox import SandboxLimits, run_program

    status, stdout = run_program(code, "", SandboxLimits(timeout_s=3.0, max_output_kb=64))
    return stdout if status == "ok" else f"{stdout}\n[{status}]"


PYTHON = register_tool(Tool(
    "python", run_python, "Run a Python program (standard library only, no network or files); returns its stdout.",
    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, timeout_s=10.0))
