"""The answers of the generation endpoints: a `View` merges a request's choices into the
API's bodies, whole (`View.whole`) or streamed (`View.chunks`).

`CompletionView` is `/v1/completions`'; the chat view lives in `chat.py` beside
the rest of what is chat's own.

A completion's `best_of` runs more sequences per prompt than it returns: the
whole answer keeps, per prompt, the `n` runs of the highest cumulative logprob,
best first (vLLM's best_of; never streamed).

A whole answer is bounded: its text and logprobs are counted as they arrive
(`AnswerSize`), and one that would pass `--max-response-bytes` is a 400 at
once, its choices aborted (without a group the answer is the prompts' echoes,
bounded by the context). Logprobs of many tokens (a prompt's) are rendered on
a thread (`logprobs.render`); `render_json` renders a whole body choice by
choice, so that a thread rendering it lets the event loop run between choices.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pydantic import BaseModel

from subway.frontend.choices import ChoiceEvent, ChoiceGroup
from subway.frontend.errors import APIError
from subway.frontend.inputs import Job, runs_per_prompt
from subway.frontend.logprobs import (
    completion_logprobs,
    entries,
    extend,
    render,
    rendered_size,
)
from subway.frontend.protocol import CompletionRequest, SamplingRequest
from subway.frontend.responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from subway.ipc.config import ServerConfig

OFFLOAD_BYTES = 64 << 10  # whole answers larger than this are assembled on a thread


class AnswerSize:
    """A whole answer's bytes so far, against `limit` (0: none): text as UTF-8, logprobs
    as `rendered_size` estimates them, and a fixed share for each choice's fields."""

    CHOICE = 256  # a choice's index, finish_reason, keys and punctuation

    def __init__(self, limit: int, choices: int) -> None:
        self.limit = limit
        self.size = 512 + self.CHOICE * choices  # id, model, usage, ...

    def add(self, text: str = "", logprobs=None) -> None:
        self.size += len(text) if text.isascii() else len(text.encode("utf-8", "replace"))
        if logprobs is not None:
            self.size += rendered_size(logprobs)
        if self.limit and self.size > self.limit:
            raise APIError(
                400,
                f"the response would be larger than this server's limit of {self.limit} "
                "bytes (--max-response-bytes): stream it, or ask for fewer tokens, choices "
                "or logprobs",
            )


def render_json(body: BaseModel) -> bytes:
    """`body` as JSON (as `model_dump_json`), its choices rendered one at a time: each call
    into pydantic's serializer holds the GIL for one choice, not for the whole answer."""
    choices = getattr(body, "choices", None)
    if not isinstance(choices, list) or len(choices) < 2:
        return body.model_dump_json().encode()
    rendered = [c.model_dump_json().encode() for c in choices]
    shell = body.model_copy(update={"choices": []}).model_dump_json().encode()
    marker = b'"choices":[]'
    at = shell.index(marker) + len(marker) - 1
    return b"".join([shell[:at], b",".join(rendered), shell[at:]])


class View:
    """What both APIs' answers share: the choices merged, the usage."""

    def __init__(
        self,
        req: SamplingRequest,
        job: Job,
        request_id: str,
        model: str,
        tokenizer,
        server: ServerConfig | None = None,
    ):
        self.req = req
        self.server = server or ServerConfig()  # the options answers follow (--reasoning-parser)
        self.job = job
        self.request_id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.n = len(job.prompts) * req.n  # choices returned: i belongs to prompt i // req.n
        self.per_prompt = runs_per_prompt(req)  # sequences run per prompt (best_of)
        self.runs = len(job.prompts) * self.per_prompt  # run i belongs to prompt i // per_prompt

    def usage(self, completion_tokens: int) -> Usage:
        prompt_tokens = self.job.prompt_tokens
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    async def whole(self, group: ChoiceGroup | None) -> BaseModel:
        """The answer in one body, once every choice has ended (no group: nothing to run).
        APIError 400 (the choices aborted) as soon as it would pass the group's `max_bytes`
        (`--max-response-bytes`)."""
        size = AnswerSize(group.max_bytes if group is not None else 0, self.runs)
        openings = self.openings()
        for text in openings:
            size.add(text)
        texts = [[t] for t in openings]  # each run's pieces (joined once, at the end)
        lengths = [len(t) for t in openings]
        counts = [0] * self.runs
        finish: list[str | None] = ["length" if group is None else None] * self.runs
        lps = [self.new_logprobs() for _ in range(self.runs)]
        cumulative = [0.0] * self.runs  # each run's summed logprob (best_of ranks by it)
        if group is not None:
            try:
                async for raw in group.events():
                    ev = self.shown(raw)
                    i = ev.index
                    if lps[i] is not None:
                        size.add(logprobs=await self.logprobs_of(ev, lengths[i], lps[i]))
                    size.add(ev.text)
                    texts[i].append(ev.text)
                    lengths[i] += len(ev.text)
                    counts[i] += len(ev.token_ids)
                    finish[i] = ev.finish_reason or finish[i]
                    cumulative[i] += sum(lp.logprob or 0.0 for lp in raw.logprobs or ())
            finally:
                group.close()  # a no-op once every choice ended; else (too large) aborts
        keep = self.best(cumulative)
        args = (
            ["".join(texts[k]) for k in keep],
            [lps[k] for k in keep],
            [finish[k] for k in keep],
            self.usage(sum(counts[k] for k in keep)),
        )
        if size.size > OFFLOAD_BYTES:  # the answer's models (and chat's parsing of calls)
            return await asyncio.to_thread(self.response, *args)
        return self.response(*args)

    def best(self, cumulative: list[float]) -> list[int]:
        """The runs returned, in the order of the answer's choices: all of them, or with
        best_of the `n` of each prompt with the highest cumulative logprob, best first."""
        per, n = self.per_prompt, self.req.n
        if per == n:
            return list(range(self.runs))
        keep = []
        for start in range(0, self.runs, per):
            runs = sorted(range(start, start + per), key=lambda k: -cumulative[k])
            keep += runs[:n]
        return keep

    # What each API does its own way.

    def openings(self) -> list[str]:
        """Each run's text before its first event."""
        return [""] * self.runs

    def shown(self, ev: ChoiceEvent) -> ChoiceEvent:
        return ev

    def new_logprobs(self):
        raise NotImplementedError

    def add_logprobs(self, into, ev: ChoiceEvent, offset: int) -> None:
        raise NotImplementedError

    async def logprobs_of(self, ev: ChoiceEvent, offset: int, into):
        """`ev`'s logprobs rendered (on a thread when they are many) and added to `into`;
        returns what was added, for the answer's size."""
        added = self.new_logprobs()
        await render(self.add_logprobs, _entries(ev), added, ev, offset)
        self.merge_logprobs(into, added)
        return added

    def merge_logprobs(self, into, more) -> None:
        raise NotImplementedError

    def response(self, texts, lps, finish, usage: Usage) -> BaseModel:
        raise NotImplementedError

    def chunks(self, group: ChoiceGroup | None) -> AsyncIterator[BaseModel]:
        raise NotImplementedError


class CompletionView(View):
    req: CompletionRequest

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None):
        return CompletionChunk(id=self.request_id, model=self.model, choices=choices, usage=usage)

    def openings(self) -> list[str]:
        """The echoes: each run's prompt, when `echo`."""
        if not self.req.echo:
            return [""] * self.runs
        prompts = [self.job.prompts[i // self.per_prompt] for i in range(self.runs)]
        return [p.text if p.text is not None else self.tokenizer.decode(p.ids) for p in prompts]

    def shown(self, ev: ChoiceEvent) -> ChoiceEvent:
        """With max_tokens 0 the generated token is dropped: the choice ends at its prompt."""
        if not self.job.no_output:
            return ev
        return ChoiceEvent(
            ev.index,
            finish_reason="length" if ev.finish_reason is not None else None,
            prompt_logprobs=ev.prompt_logprobs,
        )

    async def chunks(self, group: ChoiceGroup | None) -> AsyncIterator[CompletionChunk]:
        req = self.req
        echoes = self.openings()
        offsets = [0] * self.n
        completion_tokens = 0
        pending_echo = [bool(e) for e in echoes]  # not shown yet
        want_prompt_lps = req.echo and req.logprobs is not None
        if group is None:  # max_tokens 0, no logprobs: the echoes and we are done
            for i, echo in enumerate(echoes):
                yield self._chunk([CompletionChoice(index=i, text=echo, finish_reason="length")])
        else:
            if not want_prompt_lps:
                for i, echo in enumerate(echoes):
                    if echo:
                        yield self._chunk([CompletionChoice(index=i, text=echo)])
                        offsets[i] = len(echo)
                        pending_echo[i] = False
            async for raw in group.events():
                ev = self.shown(raw)
                completion_tokens += len(ev.token_ids)
                i = ev.index
                lp = None
                if req.logprobs is not None:
                    start = offsets[i] + len(echoes[i] if pending_echo[i] else "")
                    prompt = want_prompt_lps and ev.prompt_logprobs is not None
                    lp = await render(self._chunk_logprobs, _entries(ev), ev, prompt, start)
                text = ev.text
                if pending_echo[i]:
                    text = echoes[i] + text
                    pending_echo[i] = False
                if not (text or ev.finish_reason or (lp is not None and lp.tokens)):
                    continue
                offsets[i] += len(text)
                choice = CompletionChoice(
                    index=i, text=text, logprobs=lp, finish_reason=ev.finish_reason
                )
                yield self._chunk([choice])
        if req.include_usage:
            yield self._chunk([], self.usage(completion_tokens))

    def new_logprobs(self) -> CompletionLogprobs | None:
        return CompletionLogprobs() if self.req.logprobs is not None else None

    def merge_logprobs(self, into: CompletionLogprobs, more: CompletionLogprobs) -> None:
        extend(into, more)

    def add_logprobs(self, into: CompletionLogprobs, ev: ChoiceEvent, offset: int) -> None:
        if ev.prompt_logprobs is not None:
            extend(into, completion_logprobs(self.tokenizer, ev.prompt_logprobs, 0))
        if ev.logprobs is not None:
            extend(into, completion_logprobs(self.tokenizer, ev.logprobs, offset))

    def _chunk_logprobs(self, ev: ChoiceEvent, prompt: bool, start: int) -> CompletionLogprobs:
        """A streamed event's logprobs: the prompt's (with `prompt`), then its tokens'."""
        lp = CompletionLogprobs()
        if prompt:
            extend(lp, completion_logprobs(self.tokenizer, ev.prompt_logprobs or [], 0))
        if ev.logprobs is not None:
            extend(lp, completion_logprobs(self.tokenizer, ev.logprobs, start))
        return lp

    def response(self, texts, lps, finish, usage: Usage) -> CompletionResponse:
        choices = [
            CompletionChoice(index=i, text=texts[i], logprobs=lps[i], finish_reason=finish[i])
            for i in range(self.n)
        ]
        return CompletionResponse(
            id=self.request_id, model=self.model, choices=choices, usage=usage
        )


def _entries(ev: ChoiceEvent) -> int:
    """How many token texts rendering the event's logprobs takes, the prompt's included."""
    return entries(ev.prompt_logprobs) + entries(ev.logprobs)
