"""What is chat's own: the prompt (the chat template over the messages) and the answers.

`chat_job` turns a chat request into a `Job` (its prompt through `chat_prompt`,
its sampling through `inputs.sampling_params`); `ChatView` renders the
choices' events as chat completions, whole or streamed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from subway.frontend.choices import ChoiceEvent, ChoiceGroup
from subway.frontend.errors import APIError
from subway.frontend.inputs import (
    Job,
    Limits,
    Prompt,
    _check_length,
    encode,
    resolve_max_tokens,
    sampling_params,
)
from subway.frontend.logprobs import chat_logprobs
from subway.frontend.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    Usage,
)
from subway.frontend.views import View


def chat_job(req: ChatCompletionRequest, tokenizer, limits: Limits) -> Job:
    prompt = chat_prompt(req, tokenizer, limits)
    max_tokens = resolve_max_tokens(
        req.requested_max_tokens, len(prompt.ids), limits, limits.chat_max_tokens
    )
    top = (req.top_logprobs or 0) if req.logprobs else None
    return Job([prompt], [sampling_params(req, max_tokens, top, limits)])


def chat_prompt(
    req: ChatCompletionRequest, tokenizer, limits: Limits, check_length: bool = True
) -> Prompt:
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            tokenize=False,
            **({"chat_template": req.chat_template} if req.chat_template is not None else {}),
            **(req.chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja errors, a tokenizer without a template, ...
        raise APIError(400, f"cannot apply the chat template: {e}", "messages") from e
    prompt = Prompt(encode(tokenizer, text, False, "messages"), text)
    if check_length:
        _check_length(prompt, limits, "messages")
    return prompt


class ChatView(View):
    req: ChatCompletionRequest

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None):
        return ChatCompletionChunk(
            id=self.request_id, model=self.model, choices=choices, usage=usage
        )

    async def chunks(self, group: ChoiceGroup) -> AsyncIterator[ChatCompletionChunk]:
        req = self.req
        for i in range(req.n):
            delta = DeltaMessage(role="assistant", content="")
            yield self._chunk([ChatChunkChoice(index=i, delta=delta)])
        completion_tokens = 0
        async for ev in group.events():
            completion_tokens += len(ev.token_ids)
            if not (ev.text or ev.finish_reason or ev.logprobs):
                continue
            lp = (
                chat_logprobs(self.tokenizer, ev.logprobs) if ev.logprobs and req.logprobs else None
            )
            delta = DeltaMessage(content=ev.text or None)
            choice = ChatChunkChoice(
                index=ev.index, delta=delta, logprobs=lp, finish_reason=ev.finish_reason
            )
            yield self._chunk([choice])
        if req.include_usage:
            yield self._chunk([], self.usage(completion_tokens))

    def new_logprobs(self) -> ChatLogprobs | None:
        return ChatLogprobs(content=[]) if self.req.logprobs else None

    def add_logprobs(self, into: ChatLogprobs, ev: ChoiceEvent, offset: int) -> None:
        if ev.logprobs is not None and into.content is not None:
            into.content += chat_logprobs(self.tokenizer, ev.logprobs).content or []

    def response(self, texts, lps, finish, usage: Usage) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content=texts[i]),
                logprobs=lps[i],
                finish_reason=finish[i],
            )
            for i in range(self.n)
        ]
        return ChatCompletionResponse(
            id=self.request_id, model=self.model, choices=choices, usage=usage
        )
