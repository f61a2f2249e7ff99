"""A small Python client for Subway's OpenAI-compatible HTTP API, over httpx.

    from subway.client import HTTPClient
    http = HTTPClient("http://127.0.0.1:8000")
    print(http.complete("The capital of France is", max_tokens=8)["choices"][0]["text"])
    for piece in http.stream("Once upon a time", max_tokens=32):
        print(piece, end="", flush=True)

The `openai` package is the full-featured one. A refused or failed request
raises `RequestError` with the response's status, also when the error comes
as an event of a stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from subway.client.protocol import RequestError


class HTTPClient:
    """Completions, chat, tokenize, health and metrics; `model` defaults to the served one."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str = "",
        model: str | None = None,
        timeout: float = 300.0,
    ) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self._model = model

    def __enter__(self) -> HTTPClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self._get("/v1/models")["data"][0]["id"]
        return self._model

    def health(self) -> bool:
        try:
            return self._http.get("/health").status_code == 200
        except Exception:
            return False

    def complete(self, prompt: str | list[int] | list, **params) -> dict:
        """POST /v1/completions; the response as a dict."""
        return self._post("/v1/completions", {"model": self.model, "prompt": prompt, **params})

    def chat(self, messages: list[dict], **params) -> dict:
        return self._post(
            "/v1/chat/completions", {"model": self.model, "messages": messages, **params}
        )

    def stream(self, prompt: str | list[int], **params) -> Iterator[str]:
        """Text pieces of a streamed completion."""
        body = {"model": self.model, "prompt": prompt, **params, "stream": True}
        for event in self._events("/v1/completions", body):
            for choice in event.get("choices", []):
                if choice.get("text"):
                    yield choice["text"]

    def chat_stream(self, messages: list[dict], **params) -> Iterator[str]:
        body = {"model": self.model, "messages": messages, **params, "stream": True}
        for event in self._events("/v1/chat/completions", body):
            for choice in event.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    yield content

    def tokenize(self, prompt: str, **params) -> list[int]:
        return self._post("/tokenize", {"prompt": prompt, **params})["tokens"]

    def detokenize(self, tokens: list[int]) -> str:
        return self._post("/detokenize", {"tokens": tokens})["prompt"]

    def metrics(self) -> str:
        r = self._http.get("/metrics")
        _raise_for(r.status_code, r.text)
        return r.text

    def _get(self, path: str) -> dict:
        r = self._http.get(path)
        _raise_for(r.status_code, r.text)
        return r.json()

    def _post(self, path: str, body: dict) -> dict:
        r = self._http.post(path, json=body)
        _raise_for(r.status_code, r.text)
        return r.json()

    def _events(self, path: str, body: dict) -> Iterator[dict]:
        with self._http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                _raise_for(r.status_code, r.text)
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    raise RequestError(int(err.get("code") or 500), err.get("message", ""))
                yield event


def _raise_for(status: int, text: str) -> None:
    if status < 400:
        return
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text
    raise RequestError(status, message)
