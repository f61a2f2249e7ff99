"""The pipeline's first stage: from a request body to what the engine takes.

`parse` reads a JSON body into a request model; `completion_job` (and `chat.chat_job`)
turn a request into a `Job`: its prompts' ids and, per prompt, the
SamplingParams of its choices. Everything that needs the tokenizer or the
engine's limits (context length, vocabulary) is checked here; failures are
400s (404 for a model that is neither the served one nor one of
its LoRA adapters).

With `echo`, a completion's text starts with its prompt; with `echo` and
`logprobs`, its logprobs start with the prompt's tokens (`prompt_logprobs`),
as evaluation harnesses read them to score answers. `max_tokens` 0 is allowed
with `echo`: the prompt alone (the engine still runs the prefill when logprobs
are asked, and its one generated token is dropped; without them, nothing runs).

`sampling_params` also maps `logit_bias` (ids inside the vocabulary),
`min_tokens` (at most max_tokens) and the output's grammar (the request's
structured output, `grammar.request_grammar`, unless the caller has one of its
own: a tool call's). A completion's `best_of` runs more choices than it returns,
ranked by their cumulative logprob, so its choices always ask for the sampled
tokens' logprobs (shown only if the client asked).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ValidationError

from subway.frontend.admission import check_fan_out
from subway.frontend.errors import APIError, from_validation_error
from subway.frontend.grammar import request_grammar
from subway.frontend.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from subway.ipc.config import EngineConfig
from subway.ipc.messages import Grammar, SamplingParams

if TYPE_CHECKING:
    from subway.frontend.lora import LoraRegistry

R = TypeVar("R", bound=BaseModel)
DEFAULT_MAX_TOKENS = 16  # a completion's, as OpenAI's; a chat's is `Limits.chat_max_tokens`


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    # max_tokens of a chat request that names none (--default-max-tokens), at most the
    # context left; None: the context left (as vLLM).
    chat_max_tokens: int | None = None
    reasoning_parser: str = ""  # --reasoning-parser: a chat's JSON constraint follows the thinking
    tool_call_parser: str = "hermes"  # --tool-call-parser: the format a forced call is written in


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None  # the prompt as text, when it was given (or rendered) as text


@dataclass
class Job:
    """What one API request asks of the engine: per prompt, its ids and its choices' sampling."""

    prompts: list[Prompt]
    sampling: list[SamplingParams]  # one per prompt
    no_output: bool = False  # max_tokens 0 (echo): the choices end at their prompts
    run_engine: bool = True  # False: max_tokens 0 without logprobs, nothing to ask the engine
    lora: int = 0  # the LoRA adapter its `model` names (`LoraRegistry.resolve`); 0: the base

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)


def parse(model: type[R], body: bytes) -> R:
    """Parse a JSON body; anything wrong is a 400 (json.loads first: pydantic takes NaN literals)."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_text(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from e


def _check_text(obj, depth: int = 0) -> None:
    """Reject what JSON allows but text cannot be: lone UTF-16 surrogates (`"\\ud800"`)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, "the request holds a string that is not valid Unicode") from e
    elif depth > 64:
        raise APIError(400, "the request body is nested too deeply")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _check_text(k, depth + 1)
            _check_text(v, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            _check_text(v, depth + 1)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def check_model(req: BaseModel, config: EngineConfig, lora: LoraRegistry | None = None) -> int:
    """Any request with a `model` field: when given, the served one or (with `lora`) one of
    its adapters, else 404. The adapter's id (`LoraRegistry.resolve`); 0: the base model."""
    if lora is not None:
        return lora.resolve(req.model)
    if req.model is not None and req.model != config.model.served_model_name:
        raise APIError(404, f"the model `{req.model}` does not exist", "model")
    return 0


# Arguments of apply_chat_template that the server sets itself.
_RESERVED_TEMPLATE_ARGS = frozenset(
    {"conversation", "tokenize", "add_generation_prompt", "continue_final_message", "tools",
     "documents", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def runs_per_prompt(req: SamplingRequest) -> int:
    """Sequences run for each prompt: `n`, or a completion's `best_of`, of which the `n`
    with the highest cumulative logprob are returned (vLLM's best_of)."""
    return getattr(req, "best_of", None) or req.n


def check_request(
    req: SamplingRequest, config: EngineConfig, lora: LoraRegistry | None = None
) -> int:
    """What the HTTP endpoints refuse first: another model, a completion's `suffix`, more
    sequences (n, or best_of) than --max-seqs-per-request, a chat template from the request (unless
    --trust-request-chat-template: a template is code). The LoRA adapter `model` names (0:
    none, `check_model`)."""
    lora_id = check_model(req, config, lora)
    check_fan_out(req, config)
    limit = config.server.max_seqs_per_request
    runs = req.num_prompts * runs_per_prompt(req)
    if limit > 0 and runs > limit:
        raise APIError(
            400,
            f"{req.num_prompts} prompt(s) x best_of={runs_per_prompt(req)} make {runs} sequences; "
            f"this server takes at most {limit} per request",
            "best_of",
        )
    if isinstance(req, CompletionRequest) and req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if isinstance(req, ChatCompletionRequest):
        kwargs = req.chat_template_kwargs or {}
        if (req.chat_template is not None or "chat_template" in kwargs) and not (
            config.server.trust_request_chat_template
        ):
            raise APIError(
                400,
                "this server takes no chat template from a request "
                "(start it with --trust-request-chat-template to allow one)",
                "chat_template",
            )
        reserved = sorted(_RESERVED_TEMPLATE_ARGS.intersection(kwargs))
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {reserved}",
                           "chat_template_kwargs")  # fmt: skip
    return lora_id


CLIENT_SCHEDULING = ("priority", "slo_ttft_ms", "slo_class")
IGNORED_HEADER = "X-Subway-Ignored-Fields"


def client_scheduling(req: R, config: EngineConfig) -> tuple[R, list[str]]:
    """The request as the scheduler will see it: its `priority`, `slo_ttft_ms` and
    `slo_class` only if the server honours them (--allow-client-priority), else the
    defaults; and the names of the fields it gave that were dropped."""
    given = [f for f in CLIENT_SCHEDULING if f in req.model_fields_set]
    if config.server.allow_client_priority or not given:
        return req, []
    defaults = {f: type(req).model_fields[f].default for f in given}
    return req.model_copy(update=defaults), given


def completion_job(req: CompletionRequest, tokenizer, limits: Limits) -> Job:
    prompts = completion_prompts(req, tokenizer, limits)
    no_output = req.max_tokens == 0
    want_prompt_lps = req.echo and req.logprobs is not None
    # best_of ranks its runs by their cumulative logprob: the engine sends the sampled
    # tokens' logprobs even when the client asked none (the views show none then).
    logprobs = req.logprobs
    if logprobs is None and runs_per_prompt(req) > req.n:
        logprobs = 0
    grammar = request_grammar(req)
    sampling = []
    for prompt in prompts:
        max_tokens = resolve_max_tokens(req.max_tokens, len(prompt.ids), limits, DEFAULT_MAX_TOKENS)
        sampling.append(
            sampling_params(
                req,
                max(1, max_tokens),
                logprobs,
                limits,
                prompt_logprobs=req.logprobs if want_prompt_lps else None,
                grammar=grammar,
            )
        )
    return Job(prompts, sampling, no_output, run_engine=not no_output or want_prompt_lps)


def check_token_ids(ids: Sequence[int], limits: Limits, param: str) -> None:
    for i in ids:
        if not 0 <= i < limits.vocab_size:
            raise APIError(
                400, f"token id {i} is outside the vocabulary [0, {limits.vocab_size})", param
            )


def check_prompt_length(prompt: Prompt, limits: Limits, param: str) -> None:
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
    return prompts_of(req.prompt, tokenizer, limits, "prompt")


def prompts_of(raw: str | list, tokenizer, limits: Limits, param: str) -> list[Prompt]:
    """Prompts given as a text, token ids, or a list of either (completions' `prompt`,
    embeddings' `input`), each tokenized or checked, and within the context."""
    if isinstance(raw, str):
        items: list = [raw]
    elif raw and isinstance(raw[0], int):
        items = [raw]
    else:
        items = list(raw)
    if not items:
        raise APIError(400, f"{param} is empty", param)
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompt = Prompt(encode(tokenizer, item, True, param), item)
        else:
            check_token_ids(item, limits, param)
            prompt = Prompt(list(item))
        check_prompt_length(prompt, limits, param)
        prompts.append(prompt)
    return prompts


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
    grammar: Grammar | None = None,
) -> SamplingParams:
    """The engine's SamplingParams of one prompt's choices. `grammar`: the output's
    constraint when the caller has one of its own (a tool call's); else the request's
    structured output, if any (`grammar.request_grammar`)."""
    stop_ids = list(req.stop_token_ids or [])
    check_token_ids(stop_ids, limits, "stop_token_ids")
    top_k = req.top_k if req.top_k not in (None, 0) else -1
    bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    check_token_ids(sorted(bias), limits, "logit_bias")
    if req.min_tokens > max_tokens:
        raise APIError(
            400, f"min_tokens={req.min_tokens} is more than max_tokens={max_tokens}", "min_tokens"
        )
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
        logit_bias=bias,
        min_tokens=req.min_tokens,
        grammar=grammar if grammar is not None else request_grammar(req),
    )
