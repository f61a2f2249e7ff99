"""The answers of the generation endpoints: a `View` merges a request's choices into the
API's bodies, whole (`View.whole`) or streamed (`View.chunks`).

`CompletionView` is `/v1/completions`'; the chat view lives in `chat.py` beside
the rest of what is chat's own.

A completion's `best_of` runs more sequences per prompt than it returns: the
whole answer keeps, per prompt, the `n` runs of the highest cumulative logprob,
best first (vLLM's best_of; never streamed).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pydantic import BaseModel

from subway.frontend.choices import ChoiceEvent, ChoiceGroup
from subway.frontend.inputs import Job, runs_per_prompt
from subway.frontend.logprobs import completion_logprobs, extend
from subway.frontend.protocol import CompletionRequest, SamplingRequest
from subway.frontend.responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)


class View:
    """What both APIs' answers share: the choices merged, the usage."""

    def __init__(self, req: SamplingRequest, job: Job, request_id: str, model: str, tokenizer):
        self.req = req
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
        """The answer in one body, once every choice has ended (no group: nothing to run)."""
        texts = self.openings()
        counts = [0] * self.runs
        finish: list[str | None] = ["length" if group is None else None] * self.runs
        lps = [self.new_logprobs() for _ in range(self.runs)]
        cumulative = [0.0] * self.runs  # each run's summed logprob (best_of ranks by it)
        if group is not None:
            async for raw in group.events():
                ev = self.shown(raw)
                i = ev.index
                if lps[i] is not None:
                    self.add_logprobs(lps[i], ev, len(texts[i]))
                texts[i] += ev.text
                counts[i] += len(ev.token_ids)
                finish[i] = ev.finish_reason or finish[i]
                cumulative[i] += sum(lp.logprob or 0.0 for lp in raw.logprobs or ())
        keep = self.best(cumulative)
        return self.response(
            [texts[k] for k in keep],
            [lps[k] for k in keep],
            [finish[k] for k in keep],
            self.usage(sum(counts[k] for k in keep)),
        )

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
                    lp = CompletionLogprobs()
                    if ev.prompt_logprobs is not None and want_prompt_lps:
                        extend(lp, completion_logprobs(self.tokenizer, ev.prompt_logprobs, 0))
                    if ev.logprobs is not None:
                        start = offsets[i] + len(echoes[i] if pending_echo[i] else "")
                        extend(lp, completion_logprobs(self.tokenizer, ev.logprobs, start))
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

    def add_logprobs(self, into: CompletionLogprobs, ev: ChoiceEvent, offset: int) -> None:
        if ev.prompt_logprobs is not None:
            extend(into, completion_logprobs(self.tokenizer, ev.prompt_logprobs, 0))
        if ev.logprobs is not None:
            extend(into, completion_logprobs(self.tokenizer, ev.logprobs, offset))

    def response(self, texts, lps, finish, usage: Usage) -> CompletionResponse:
        choices = [
            CompletionChoice(index=i, text=texts[i], logprobs=lps[i], finish_reason=finish[i])
            for i in range(self.n)
        ]
        return CompletionResponse(
            id=self.request_id, model=self.model, choices=choices, usage=usage
        )
