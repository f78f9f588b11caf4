"""Users of a gateway in the sandbox scenarios: streamed chat completions through TLS, one at a
time or looping until stopped, each recorded (status, finish reason, first token, error)."""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

QUESTION = {"role": "user", "content": "What is the capital of France? Answer in one word."}


@dataclass(frozen=True)
class Endpoint:
    """A gateway as one user sees it: its URL, the certificate to trust (the deploy's copy
    beside the inventory), the user's key and the model asked for."""

    url: str
    cafile: Path
    key: str
    model: str

    def tls(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cafile))


def stream_chat(endpoint: Endpoint, tokens: int, said: dict) -> None:
    """One streamed chat completion of ``tokens`` tokens through the gateway; ``said`` gets
    the HTTP status, the finish reason, the chunks, the start and end, and any error."""
    body = {"model": endpoint.model, "messages": [QUESTION], "max_tokens": tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}  # fmt: skip
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {endpoint.key}"}
    request = urllib.request.Request(
        endpoint.url + "/v1/chat/completions", json.dumps(body).encode(), headers
    )
    said.update(start=time.monotonic(), chunks=0)
    try:
        with urllib.request.urlopen(request, timeout=300, context=endpoint.tls()) as reply:
            said["status"] = reply.status
            for line in reply:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[len(b"data: ") :])
                    said["chunks"] += 1
                    said.setdefault("first", time.monotonic())
                    reason = (chunk.get("choices") or [{}])[0].get("finish_reason")
                    said["finish"] = reason or said.get("finish")
    except urllib.error.HTTPError as error:
        said.update(
            status=error.code,
            body=error.read().decode(),
            retry_after=error.headers.get("Retry-After"),
        )
    except Exception as error:  # noqa: BLE001 - whatever cut the stream is the finding
        said["error"] = repr(error)
    said["end"] = time.monotonic()


def whole(record: dict) -> bool:
    """A request that ended 200 with its stream whole (cut at max_tokens, as asked)."""
    return (
        record.get("status") == 200 and record.get("finish") == "length" and "error" not in record
    )


class Streaming:
    """``count`` clients, each sending a streamed chat as soon as its last ended, until
    stopped (bounded: ``most`` requests each, 15 minutes)."""

    def __init__(self, endpoint: Endpoint, count: int, tokens: int = 24, most: int = 300):
        self.records: list[dict] = []
        self.stop = threading.Event()
        deadline = time.monotonic() + 900

        def client() -> None:
            for _ in range(most):
                if self.stop.is_set() or time.monotonic() > deadline:
                    return
                record: dict = {}
                stream_chat(endpoint, tokens, record)
                self.records.append(record)

        self.threads = [threading.Thread(target=client) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def finish(self) -> list[dict]:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=300)
        return self.records
