"""The frontend's part of the configuration (`EngineConfig.server`)."""

from __future__ import annotations

from dataclasses import dataclass

from subway.ipc.options import opt


@dataclass(frozen=True)
class ServerConfig:
    """The frontend's doors: HTTP and the native ZMQ endpoint, and their limits."""

    host: str = opt("127.0.0.1", "HTTP address")
    port: int = opt(8000, "HTTP port")
    api_key: str = opt("", "require this bearer token (visible in ps: prefer the file or "
                       "SUBWAY_API_KEY)")  # fmt: skip
    api_key_file: str = opt("", "read the API key from this file (mode 0600)")
    max_waiting: int = opt(1024, "sequences waiting at most; more get 429 with Retry-After")
    max_queued_tokens: int = opt(
        1 << 21, "prompt tokens waiting at most; more get 429 with Retry-After"
    )
    max_seqs_per_request: int = opt(64, "prompts x n of one request at most")
    max_unread_tokens: int = opt(
        1 << 22,
        "generated tokens the frontend holds for streams' readers at most (a token "
        "with k top logprobs counts 1 + k); past it the stream furthest behind is aborted",
    )
    default_max_tokens: int = opt(
        2048, "max_tokens of a chat request that names none (capped by the context)"
    )
    header_timeout: float = opt(10.0, "seconds a client has to send its request's headers")
    body_timeout: float = opt(30.0, "seconds a client has to send its request's body")
    max_connections: int = opt(2048, "open HTTP connections at most; more are refused")
    template_timeout: float = opt(10.0, "seconds a chat template and tokenization may take")
    grammar_timeout: float = opt(10.0, "seconds a structured-output grammar may take to compile; slower ones get 400")  # fmt: skip
    grammar_workers: int = opt(
        2, "processes that compile grammars for the frontend's check (killed past the limit)"
    )
    request_timeout: float = opt(0.0, "seconds a generation request may run; 0: no limit")
    shutdown_timeout: float = opt(5.0, "seconds SIGTERM waits for requests in flight")
    allow_client_priority: bool = opt(
        False, "honour a request's priority, slo_ttft_ms and slo_class (else ignored)"
    )
    trust_request_chat_template: bool = opt(
        False, "accept a chat template from a request (it is code the server runs)"
    )
    reasoning_parser: str = opt("", "split the model's `<think>...</think>` from the answer into `reasoning_content` (vLLM's --reasoning-parser)", choices=("", "deepseek_r1", "qwen3"))  # fmt: skip
    tool_call_parser: str = opt("hermes", "the format of tool calls a model writes freely (tool_choice auto; vLLM's --tool-call-parser); auto: the one the chat template asks for", choices=("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "auto"))  # fmt: skip
    embedding_pooling: str = opt(
        "last", "/v1/embeddings and /v1/score: the prompt's final hidden states pooled as its "
        "last position's or their mean (a request's `pooling` may choose)",
        choices=("last", "mean"),
    )  # fmt: skip
    responses_store_max: int = opt(
        1024, "responses of /v1/responses kept in memory for previous_response_id, GET and "
        "background runs (store: true), oldest dropped first; 0: none kept (store is ignored)"
    )  # fmt: skip
    responses_store_bytes: int = opt(
        256 << 20, "bytes (as JSON) of the responses kept at most, conversations included"
    )
    responses_store_ttl: float = opt(
        3600.0, "seconds a kept response lives; 0: until dropped for room"
    )
    max_logprobs: int = opt(
        20, "top logprobs a request may ask per token (vLLM's --max-logprobs; 20, OpenAI's "
        "bound, at most); more get 400"
    )  # fmt: skip
    max_prompt_logprobs_tokens: int = opt(
        8192, "prompt tokens a request may ask logprobs of (echo with logprobs); longer "
        "prompts get 400; 0: no limit"
    )  # fmt: skip
    max_response_bytes: int = opt(
        32 << 20, "bytes of one whole (not streamed) response, /tokenize's and /detokenize's "
        "too; larger get 400 (a stream has no such limit); 0: no limit"
    )  # fmt: skip
    client_addr: str = opt("", 'native ZMQ client endpoint (default ipc://RUN_DIR/client.sock); '
                           '"off": none')  # fmt: skip
    client_curve_key_file: str = opt(
        "",
        "CurveZMQ key file (mode 0600; `subway keygen FILE`) of a tcp:// --client-addr: "
        "clients need its public key (FILE.pub)",
    )
