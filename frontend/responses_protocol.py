"""The Responses API's request (`POST /v1/responses`), as OpenAI documents it.

Input items are kept as plain JSON objects and checked item by item where they are
translated (`responses_api.chat_messages`): the API has many item types, and an
unknown one is a 400 naming its place, not a pydantic union's wall of errors.
Fields that the chat endpoint takes as extensions (`top_k`, `seed`, `stop`,
`structured_outputs`, `chat_template_kwargs`, ...) are taken here too, as vLLM does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from subway.frontend.protocol import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_TEMPERATURE,
    StructuredOutputs,
)

MAX_INPUT_ITEMS = 4096
MAX_METADATA = 16  # OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512


class Strict(BaseModel):
    """As the chat endpoint's requests: JSON types strictly, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("schema", max_length=256)
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs its schema")
        return self


class TextConfig(Strict):
    format: TextFormat | None = None


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list = Field(max_length=MAX_INPUT_ITEMS)  # items checked in translation
    instructions: str | None = None
    tools: list | None = Field(None, max_length=128)  # each checked in `chat_request`
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=128)
    background: bool = False
    stream: bool = False
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    # Extensions, as the chat endpoint takes them (vLLM's).
    stop: str | list[str] | None = None
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    structured_outputs: StructuredOutputs | None = None
    chat_template_kwargs: dict | None = None
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    timeout: float | None = Field(None, gt=0.0, le=1e6)

    @field_validator("metadata")
    @classmethod
    def _small_metadata(cls, v):
        if v is None:
            return v
        if len(v) > MAX_METADATA:
            raise ValueError(f"metadata has at most {MAX_METADATA} pairs")
        if any(len(k) > 64 or len(x) > 512 for k, x in v.items()):
            raise ValueError("metadata keys have at most 64 characters, values 512")
        return v

    @model_validator(mode="after")
    def _background_is_stored(self):
        if self.background and not self.store:
            raise ValueError("a background response must be stored (store: true)")
        if self.background and self.stream:
            raise ValueError("a background response cannot be streamed here: poll it by id")
        return self
