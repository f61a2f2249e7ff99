"""From a parsed request to what the engine takes: prompt ids and SamplingParams.

Everything that needs the tokenizer or the engine's limits (context length,
vocabulary) is checked here; failures are 400s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from subway.frontend.errors import APIError
from subway.frontend.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from subway.ipc.messages import SamplingParams


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None  # the prompt as text, when it was given (or rendered) as text


def check_token_ids(ids: Sequence[int], limits: Limits, param: str) -> None:
    for i in ids:
        if not 0 <= i < limits.vocab_size:
            raise APIError(
                400, f"token id {i} is outside the vocabulary [0, {limits.vocab_size})", param
            )


def _check_length(prompt: Prompt, limits: Limits, param: str) -> None:
    if not prompt.ids:
        raise APIError(400, "the prompt is empty", param)
    if len(prompt.ids) >= limits.max_model_len:
        raise APIError(
            400,
            f"the prompt has {len(prompt.ids)} tokens; the context is {limits.max_model_len} "
            "and must hold at least one generated token",
            param,
        )


def encode(tokenizer, text: str, add_special_tokens: bool, param: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as e:  # the tokenizer refuses the text: the client's fault
        raise APIError(400, f"cannot tokenize the {param}: {e}", param) from e


def completion_prompts(req: CompletionRequest, tokenizer, limits: Limits) -> list[Prompt]:
    raw = req.prompt
    if isinstance(raw, str):
        items: list = [raw]
    elif raw and isinstance(raw[0], int):
        items = [raw]
    else:
        items = list(raw)
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompt = Prompt(encode(tokenizer, item, True, "prompt"), item)
        else:
            check_token_ids(item, limits, "prompt")
            prompt = Prompt(list(item))
        _check_length(prompt, limits, "prompt")
        prompts.append(prompt)
    return prompts


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
            **(req.chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja errors, a tokenizer without a template, ...
        raise APIError(400, f"cannot apply the chat template: {e}", "messages") from e
    prompt = Prompt(encode(tokenizer, text, False, "messages"), text)
    if check_length:
        _check_length(prompt, limits, "messages")
    return prompt


def resolve_max_tokens(
    requested: int | None, prompt_len: int, limits: Limits, default: int | None
) -> int:
    """`default` None: the rest of the context (chat, as vLLM)."""
    room = limits.max_model_len - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(
            400,
            f"max_tokens={requested} plus the prompt's {prompt_len} tokens exceeds "
            f"the context of {limits.max_model_len} tokens",
            "max_tokens",
        )
    return requested


def sampling_params(
    req: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    limits: Limits,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    stop_ids = list(req.stop_token_ids or [])
    check_token_ids(stop_ids, limits, "stop_token_ids")
    top_k = req.top_k if req.top_k not in (None, 0) else -1
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of n: a seeded request's choices draw from seeds seed, seed+1, ... (as
    vLLM), so that they differ from each other but are reproducible."""
    if sampling.seed is None or index == 0:
        return sampling
    return msgspec.structs.replace(sampling, seed=sampling.seed + index)
