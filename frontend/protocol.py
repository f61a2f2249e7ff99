"""OpenAI API request models (completions, chat completions, tokenize); the responses are `responses.py`'s.

Requests reject NaN and infinities, out-of-range sampling values, unknown
content part types, values of the wrong JSON type (`"stream": "yes"`: strict
mode), stop strings beyond `MAX_STOP_STRINGS` of `MAX_STOP_CHARS` characters
each (each is matched against the text after every token) and `logit_bias` keys
that are not plain decimal integers ("²", "０", " 1") at parse time; checks that
need the engine (context length, vocabulary) live in `inputs.py`. Unknown
request fields are ignored, as the OpenAI clients send some (`user`, ...) that
change nothing here. Integers are bounded so that every accepted value fits the
engine's 64-bit fields, and the temperature and repetition penalty so that the
sampler's float32 logits stay finite.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16  # stop strings of one request at most
MAX_STOP_CHARS = 256  # characters of one stop string at most
MAX_LOGIT_BIAS = 1024  # logit_bias entries at most (as ipc.messages allows)
# A logit_bias key: a plain decimal integer in ASCII digits. str.isdigit() takes "²" (which
# int() refuses) and int() takes "０", " 1", "1_0" and "+1": neither is the test.
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}")
# The sampler divides float32 logits by these: past the bounds, a value overflows (1e308
# is inf in float32, 5e-324 is 0), the logits turn to NaN and a grammar's mask no longer
# holds. No sampling needs more.
MAX_TEMPERATURE = 1e4
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-4, 1e4

# ---------------------------------------------------------------- requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# ---- structured outputs (the grammar a request's output must follow)


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: exactly one of the constraints below."""

    model_config = ConfigDict(
        extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True
    )
    json_: dict | str | None = Field(None, alias="json")  # a JSON schema (or its text)
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None  # EBNF (xgrammar's dialect, as vLLM's)
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False  # JSON without free whitespace (", " and ": ")


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(
        extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True
    )
    name: str = Field("schema", max_length=256)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(_Request):
    """Fields shared by both endpoints; `None` means "the default"."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(
        None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> [-100, 100]
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # The older vLLM spellings of structured_outputs (one of them at most).
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Subway extras: the scheduler's policies, and a per-request time limit.
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    slo_ttft_ms: float | None = Field(None, gt=0.0)
    slo_class: Literal["interactive", "batch"] = "interactive"
    timeout: float | None = Field(None, gt=0.0, le=1e6)  # seconds; then finish_reason "abort"

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _few_stop_ids(cls, v):
        if v is not None and len(v) > 1024:
            raise ValueError("at most 1024 stop token ids")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has at most {MAX_LOGIT_BIAS} entries")
        for k, b in v.items():
            if not _TOKEN_ID_KEY.fullmatch(k):
                raise ValueError(
                    f"logit_bias keys are token ids (decimal integers), not {k[:32]!r}"
                )
            if not -100.0 <= b <= 100.0:
                raise ValueError("a logit_bias value is outside [-100, 100]")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_prompts(self) -> int:
        """Prompts in the request (each runs `n` choices)."""
        return 1


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 is allowed with `echo`: the prompt (and its logprobs) without generating.
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and len(v) > 1024 and not isinstance(v[0], int):
            raise ValueError("at most 1024 prompts in a batch")
        return v

    @property
    def num_prompts(self) -> int:
        p = self.prompt
        return 1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p)

    @model_validator(mode="after")
    def _checks(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.stream and (self.best_of or self.n) > self.n:
            raise ValueError("best_of cannot be used with stream")
        return self


class ContentPart(_Request):
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"content part type {v!r} is not supported (only 'text')")
        return v


# ---- tools (function calling)


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (an object)
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(_Request):
    """A call as it appears in an assistant message of the conversation (and in answers)."""

    name: str
    arguments: str = ""  # JSON text


class ToolCall(_Request):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text or "" for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a last message from the assistant")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(_Request):
    """`/tokenize`: a `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class LoadLoraAdapterRequest(_Request):
    """`/v1/load_lora_adapter` (vLLM's body): serve the PEFT folder `lora_path` as the model
    `lora_name`."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(_Request):
    """`/v1/unload_lora_adapter` (vLLM's body; its `lora_int_id` is not needed here)."""

    lora_name: str = Field(min_length=1, max_length=128)
