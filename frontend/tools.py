"""Tool (function) calling on /v1/chat/completions: the request's tools checked, rendered
into the prompt, turned into an output constraint, and the output parsed into calls.

`tool_choice` (`tool_mode`), as vLLM's:

- "none" (the default without tools): the tools are not rendered (a model told about
  tools writes calls that nobody would parse; vLLM renders them by default) and the
  output is never parsed into calls;
- "auto" (the default with tools): the output is free; `HermesParser` finds
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in it, or
  another format's parser under `--tool-call-parser` (`tool_formats.py`; `auto`:
  the format the chat template asks for, `call_format`);
- "required": the output is constrained to one call or more of the tools (one
  without `parallel_tool_calls`), written in the format the model writes freely
  (`call_format`) and read by that format's parser (`tool_grammars.py`);
- a named function: the same, exactly one call of that function.

Templates that know tools (they mention `tools`, as Qwen2.5's) get them as
`tools=[...]` and the conversation's calls as `tool_calls`; a template that does
not (SmolLM2's plain ChatML) gets a Hermes-style system prompt that lists the
functions, the calls as `<tool_call>` blocks and the results as `<tool_response>`
blocks in a user turn (`template_messages`).

The parsers of the output are `tool_parsers.py`'s.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema

from subway.frontend.errors import APIError
from subway.frontend.grammar import request_grammar
from subway.frontend.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    NamedToolChoice,
    ToolCall,
)
from subway.frontend.tool_formats import auto_parser, template_format
from subway.frontend.tool_grammars import forced_calls
from subway.frontend.tool_parsers import CALL_END, CALL_START, ToolParser
from subway.ipc.messages import Grammar

ToolMode = Literal["none", "auto", "required", "named"]
NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_mode(req: ChatCompletionRequest) -> ToolMode:
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return "named"
    if choice is None or choice == "auto":  # auto without tools: nothing to call
        return "auto" if req.tools else "none"
    return choice


def check_tools(req: ChatCompletionRequest) -> None:
    """The 400s of a request's tools and tool_choice."""
    tools = req.tools or []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in names:
            raise APIError(400, f"two tools are named {fn.name!r}", f"tools[{i}].function.name")
        names.add(fn.name)
        _check_parameters(fn, f"tools[{i}].function.parameters")
    if tool_mode(req) not in ("required", "named"):
        return
    choice = req.tool_choice
    if not tools:
        raise APIError(400, "tool_choice required or a named function needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(
            400, f"tool_choice names {choice.function.name!r}, which is not a tool", "tool_choice"
        )
    if request_grammar(req) is not None:  # the request asks for structured output itself
        raise APIError(
            400,
            "tool_choice required or a named function constrains the output itself: "
            "it cannot be combined with response_format or structured_outputs",
            "tool_choice",
        )


def _check_parameters(fn: FunctionDefinition, param: str) -> None:
    schema = fn.parameters
    if schema is None:
        return
    kind = schema.get("type", "object")
    if kind != "object":
        raise APIError(400, f"the parameters of {fn.name!r} must be an object's schema, "
                       f"not of type {json.dumps(kind)[:64]}", param)  # fmt: skip
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise APIError(400, f"the parameters of {fn.name!r} are not a valid JSON schema: "
                       f"{e.message[:200]}", param) from None  # fmt: skip
    except Exception as e:  # an unresolvable $schema, a recursion: still the client's
        raise APIError(400, f"the parameters of {fn.name!r} are not a usable JSON schema: "
                       f"{type(e).__name__}", param) from None  # fmt: skip


# ---------------------------------------------------------------- constraints


def parameters_schema(fn: FunctionDefinition) -> dict:
    return fn.parameters if fn.parameters is not None else NO_PARAMETERS


def tool_grammar(req: ChatCompletionRequest, fmt: str = "hermes") -> Grammar | None:
    """The output constraint of the request's tool_choice (None: unconstrained), its calls
    written in format `fmt` (`call_format`)."""
    mode = tool_mode(req)
    if mode == "required":
        functions = [(t.function.name, parameters_schema(t.function)) for t in req.tools or []]
        return forced_calls(fmt, functions, at_most_one=not req.parallel_tool_calls)
    if mode == "named":
        fn = named_function(req)
        return forced_calls(fmt, [(fn.name, parameters_schema(fn))], at_most_one=True)
    return None


def named_function(req: ChatCompletionRequest) -> FunctionDefinition:
    choice = req.tool_choice
    assert isinstance(choice, NamedToolChoice)
    return next(t.function for t in req.tools or [] if t.function.name == choice.function.name)


# ---------------------------------------------------------------- rendering


def rendered_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools as the prompt shows them (None: not shown, as with tool_choice "none")."""
    if not req.tools or tool_mode(req) == "none":
        return None
    return [
        {
            "type": "function",
            "function": t.function.model_dump(exclude_none=True, exclude={"strict"}),
        }
        for t in req.tools
    ]


def template_source(tokenizer, chat_template: str | None, with_tools: bool) -> str:
    """The template text apply_chat_template will use (a tokenizer may hold named ones)."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        if chat_template in own:
            return own[chat_template]
        if chat_template is None:
            return own.get("tool_use" if with_tools and "tool_use" in own else "default", "")
    return chat_template if chat_template is not None else own or ""


def template_takes_tools(source: str) -> bool:
    return "tools" in source


def hermes_system_prompt(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to answer the user. The functions are "
        "described by their JSON signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, answer with a JSON object holding the function's name "
        "and its arguments within <tool_call></tool_call> XML tags:\n"
        f'{CALL_START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_END}'
    )


def template_messages(
    messages: list[ChatMessage], tools: list[dict] | None, native: bool
) -> list[dict]:
    """The conversation as the chat template takes it; `native`: the template knows tools."""
    if native:
        return [_native_message(m) for m in messages]
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m.role == "tool":  # consecutive results share one user turn
            block = f"<tool_response>\n{m.text()}\n</tool_response>"
            if i and messages[i - 1].role == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif m.tool_calls:
            blocks = "\n".join(_call_block(c) for c in m.tool_calls)
            text = m.text()
            out.append({"role": m.role, "content": f"{text}\n{blocks}" if text else blocks})
        else:
            out.append({"role": m.role, "content": m.text()})
    if tools:
        prompt = hermes_system_prompt(tools)
        system = next((m for m in out if m["role"] == "system"), None)
        if system is not None:
            system["content"] = f"{system['content']}\n\n{prompt}" if system["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments(text: str):
    """A call's arguments as templates take them: the parsed object (its text if not JSON)."""
    try:
        return json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack
        return text


def _call_block(call: ToolCall) -> str:
    args = _arguments(call.function.arguments)
    body = {"name": call.function.name, "arguments": args}
    return f"{CALL_START}\n{json.dumps(body, ensure_ascii=False)}\n{CALL_END}"


def _native_message(m: ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments),
                },
            }
            for c in m.tool_calls
        ]
    if m.role == "tool":
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            out["name"] = m.name
    return out


# ---------------------------------------------------------------- parsing the output


def call_format(req: ChatCompletionRequest, flag: str, tokenizer=None) -> str:
    """The format of calls a model writes freely under `--tool-call-parser` `flag`; `auto`:
    the one the chat template the request gets asks for (`tool_formats.template_format`),
    hermes for a template that does not take tools (our system prompt asks for Hermes
    blocks). Without `tokenizer` only the request's own template is known."""
    if flag != "auto":
        return flag
    source = template_source(tokenizer, req.chat_template, True)
    return template_format(source) if template_takes_tools(source) else "hermes"


def tool_parser(
    req: ChatCompletionRequest, auto: str = "hermes", tokenizer=None
) -> ToolParser | None:
    """A parser for one choice of `req` (None: the output is only content); `auto`: the
    format of calls the model writes freely (`--tool-call-parser`, `tool_formats.py`);
    `tokenizer`: whose chat template `--tool-call-parser auto` reads (`call_format`)."""
    if tool_mode(req) == "none":
        return None
    return auto_parser(call_format(req, auto, tokenizer), req.tools)


def finish_reason(reason: str | None, parser: ToolParser | None) -> str | None:
    """A choice that made calls ends with "tool_calls", unless cut ("length", "abort", ...)."""
    if reason == "stop" and parser is not None and parser.calls:
        return "tool_calls"
    return reason
