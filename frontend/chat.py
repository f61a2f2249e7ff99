"""What is chat's own: the prompt (the chat template over the messages) and the answers.

`chat_job` turns a chat request into a `Job` (its prompt through `chat_prompt`,
its sampling through `inputs.sampling_params`, constrained for tool calls);
`ChatView` renders the choices' events as chat completions, whole or streamed,
with each choice's output split into its reasoning and its answer under
`--reasoning-parser` (`reasoning.py`), and the answer parsed into tool calls
when the request's tool_choice says so (`tools.py`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import msgspec

from subway.frontend.choices import ChoiceEvent, ChoiceGroup
from subway.frontend.errors import APIError
from subway.frontend.inputs import (
    Job,
    Limits,
    Prompt,
    check_prompt_length,
    encode,
    resolve_max_tokens,
    sampling_params,
)
from subway.frontend.logprobs import chat_logprobs, entries, render
from subway.frontend.protocol import ChatCompletionRequest
from subway.frontend.reasoning import ReasoningParser, reasoning_parser
from subway.frontend.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ResponseFunctionCall,
    ResponseToolCall,
    Usage,
)
from subway.frontend.tool_parsers import CallPiece, Piece, ToolParser
from subway.frontend.tools import (
    call_format,
    check_tools,
    finish_reason,
    rendered_tools,
    template_messages,
    template_source,
    template_takes_tools,
    tool_grammar,
    tool_parser,
)
from subway.frontend.views import View
from subway.ipc.messages import SamplingParams


def chat_job(req: ChatCompletionRequest, tokenizer, limits: Limits) -> Job:
    check_tools(req)
    prompt = chat_prompt(req, tokenizer, limits)
    max_tokens = resolve_max_tokens(
        req.requested_max_tokens, len(prompt.ids), limits, limits.chat_max_tokens
    )
    top = (req.top_logprobs or 0) if req.logprobs else None
    # None: the request's own structured output, if any
    grammar = tool_grammar(req, call_format(req, limits.tool_call_parser, tokenizer))
    sampling = sampling_params(req, max_tokens, top, limits, grammar=grammar)
    return Job([prompt], [after_thinking(sampling, limits.reasoning_parser)])


AFTER_THINKING = ("json_schema", "json_object", "structural_tag")


def after_thinking(sampling: SamplingParams, parser: str) -> SamplingParams:
    """With a reasoning parser, a JSON constraint (a schema, json_object) or a forced tool
    call holds the answer after the think block, not the thinking (`Grammar.think`:
    DeepSeek-R1's prompt opens the block, Qwen3's output may). A regex, choice or EBNF
    grammar holds the whole output as written: it may spell out the think block itself."""
    grammar = sampling.grammar
    if not parser or grammar is None or grammar.kind not in AFTER_THINKING:
        return sampling
    think = "open" if parser == "deepseek_r1" else "optional"
    return msgspec.structs.replace(sampling, grammar=msgspec.structs.replace(grammar, think=think))


def chat_prompt(
    req: ChatCompletionRequest, tokenizer, limits: Limits, check_length: bool = True
) -> Prompt:
    """The conversation through the chat template, with the request's tools: as the
    template's `tools` if it knows them, else as a system prompt of our own."""
    tools = rendered_tools(req)
    native = template_takes_tools(template_source(tokenizer, req.chat_template, bool(tools)))
    messages = template_messages(req.messages, tools, native)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            tokenize=False,
            **({"tools": tools} if tools and native else {}),
            **({"chat_template": req.chat_template} if req.chat_template is not None else {}),
            **(req.chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja errors, a tokenizer without a template, ...
        raise APIError(400, f"cannot apply the chat template: {e}", "messages") from e
    prompt = Prompt(encode(tokenizer, text, False, "messages"), text)
    if check_length:
        check_prompt_length(prompt, limits, "messages")
    return prompt


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatView(View):
    req: ChatCompletionRequest

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None):
        return ChatCompletionChunk(
            id=self.request_id, model=self.model, choices=choices, usage=usage
        )

    def _reasoning_parser(self) -> ReasoningParser | None:
        """A choice's reasoning parser (None: no --reasoning-parser). An output held to a
        grammar from its first token (a regex, choice or EBNF one: `after_thinking`) has no
        room to think unless the grammar writes `<think>` itself, so it is reasoning only
        from a `<think>` at its start, whichever parser."""
        constrained = any(
            sp.grammar is not None and not sp.grammar.think for sp in self.job.sampling
        )
        return reasoning_parser(self.server.reasoning_parser, constrained)

    async def chunks(self, group: ChoiceGroup) -> AsyncIterator[ChatCompletionChunk]:
        req = self.req
        parsers = [
            tool_parser(req, self.server.tool_call_parser, self.tokenizer) for _ in range(self.n)
        ]
        reasoners = [self._reasoning_parser() for _ in range(self.n)]
        for i in range(req.n):
            delta = DeltaMessage(role="assistant", content="")
            yield self._chunk([ChatChunkChoice(index=i, delta=delta)])
        completion_tokens = 0
        async for ev in group.events():
            completion_tokens += len(ev.token_ids)
            parser, last = parsers[ev.index], ev.finish_reason is not None
            reasoning, text = _split(reasoners[ev.index], ev.text, last)
            delta = (
                _delta(parser, text, last, reasoning)
                if parser is not None
                else DeltaMessage(content=text or None, reasoning_content=reasoning or None)
            )
            finish = finish_reason(ev.finish_reason, parser)
            shown = delta.content or delta.reasoning_content or delta.tool_calls
            if not (shown or finish or ev.logprobs):
                continue
            lp = None
            if ev.logprobs and req.logprobs:
                lp = await render(chat_logprobs, entries(ev.logprobs), self.tokenizer, ev.logprobs)
            choice = ChatChunkChoice(index=ev.index, delta=delta, logprobs=lp, finish_reason=finish)
            yield self._chunk([choice])
        if req.include_usage:
            yield self._chunk([], self.usage(completion_tokens))

    def new_logprobs(self) -> ChatLogprobs | None:
        return ChatLogprobs(content=[]) if self.req.logprobs else None

    def add_logprobs(self, into: ChatLogprobs, ev: ChoiceEvent, offset: int) -> None:
        if ev.logprobs is not None and into.content is not None:
            into.content += chat_logprobs(self.tokenizer, ev.logprobs).content or []

    def merge_logprobs(self, into: ChatLogprobs, more: ChatLogprobs) -> None:
        if into.content is not None:
            into.content += more.content or []

    def response(self, texts, lps, finish, usage: Usage) -> ChatCompletionResponse:
        choices = []
        for i in range(self.n):
            parser = tool_parser(self.req, self.server.tool_call_parser, self.tokenizer)
            message = _answer(texts[i], parser, self._reasoning_parser())
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=lps[i],
                    finish_reason=finish_reason(finish[i], parser),
                )
            )
        return ChatCompletionResponse(
            id=self.request_id, model=self.model, choices=choices, usage=usage
        )


def _split(reasoner: ReasoningParser | None, text: str, last: bool) -> tuple[str, str]:
    """The (reasoning, answer) of a piece of a choice's output; all answer without a
    reasoning parser. `last`: the output has ended, nothing is held back."""
    if reasoner is None:
        return "", text
    reasoning, answer = reasoner.feed(text) if text else ("", "")
    if last:
        more = reasoner.finish()
        reasoning, answer = reasoning + more[0], answer + more[1]
    return reasoning, answer


def _answer(text: str, parser: ToolParser | None, reasoner: ReasoningParser | None):
    """A whole choice's message: without a reasoning parser, as it always was; with one,
    the reasoning apart (null if none) and the answer's content null when it is empty
    but the reasoning or calls are not (vLLM's)."""
    reasoning, text = _split(reasoner, text, True)
    if parser is None:
        message = AssistantMessage(content=text)
    else:
        message = _message(parser.feed(text) + parser.finish())
    if reasoner is None:
        return message
    empty = None if reasoning or message.tool_calls else ""
    return AssistantMessage(
        content=message.content or empty,
        tool_calls=message.tool_calls,
        reasoning_content=reasoning or None,
    )


def _delta(parser: ToolParser, text: str, last: bool, reasoning: str = "") -> DeltaMessage:
    """One streamed piece of a choice whose output is parsed for calls: its reasoning (with
    a reasoning parser), its content and its pieces of calls (the first piece of a call
    names it and gets the call's id)."""
    pieces = parser.feed(text) if text else []
    if last:
        pieces += parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [
        DeltaToolCall(
            index=p.index,
            id=new_call_id() if p.name is not None else None,
            type="function" if p.name is not None else None,
            function=DeltaFunctionCall(name=p.name, arguments=p.arguments),
        )
        for p in pieces
        if isinstance(p, CallPiece)
    ]
    return DeltaMessage(
        content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None
    )


def _message(pieces: list[Piece]) -> AssistantMessage:
    """A whole answer from its pieces: the content (None if there were calls and no text)
    and the calls, their pieces joined by index."""
    content = "".join(p for p in pieces if isinstance(p, str))
    calls: list[ResponseToolCall] = []
    for p in pieces:
        if isinstance(p, str):
            continue
        if p.name is not None:
            calls.append(ResponseToolCall(id=new_call_id(), function=ResponseFunctionCall(
                name=p.name, arguments=p.arguments)))  # fmt: skip
        else:
            calls[p.index].function.arguments += p.arguments
    return AssistantMessage(content=content or (None if calls else ""), tool_calls=calls)
