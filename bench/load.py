"""Served throughput against the engine's own ceiling: K clients at once against a deployed
rig's llama-server, beside `llama-batched-bench` of the same build, model, context and lengths.

For each K (1, 2, 4, ... bounded by the rig's slots x 2): ``--rounds`` rounds in which K
streaming chat completions start together, each with its own prompt (a distinct first line,
so no slot reuses another's cached prompt) of about ``--prompt-words`` words and exactly
``--tokens`` output tokens (``ignore_eos``). Per K: aggregate output tokens/s (K x tokens over
the round's wall time; the median round), p50/p95 time to first token and inter-token gap over
every request, and errors. The ceiling at the same batch is llama-batched-bench's end-to-end
rate of its ``pl`` sequences (prompt ``pp`` = the prompt tokens the server counted, ``tg`` =
``--tokens``): ``pl x tg / (t_pp + t_tg)``. Served / ceiling per K is the headline.

Loopback only (a remote rig through an SSH tunnel); every request and the whole run are
bounded. An API key is read from a file and sent as a header, never printed.

python -m bench.load --url http://127.0.0.1:8080 --clients 1,2,4 --tokens 64 --out load.json \\
    [--batched-bench "/opt/llamarig/current/bin/llama-batched-bench -m MODEL -c CTX"]
    [--ceiling-jsonl FILE]     # llama-batched-bench's --output-format jsonl, run elsewhere
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import shlex
import statistics
import subprocess
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llamarig.serving.throughput import PROMPT_TEXT, percentile

REQUEST_TIMEOUT_S = 600


def prompt(index: int, words: int) -> str:
    text = PROMPT_TEXT + " "
    body = (text * (words // len(PROMPT_TEXT.split()) + 1)).split()[:words]
    return f"Request {index}.\n" + " ".join(body)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Client:
    """Streaming chat completions against one server; the key, if any, only in a header."""

    def __init__(self, url: str, api_key: str | None, model: str | None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise SystemExit(f"--url: {url!r} is not an http:// URL")
        if not _loopback(parts.hostname):
            raise SystemExit(
                f"--url: {parts.hostname} is not a loopback address: reach a rig through a "
                "tunnel (ssh -L 8080:127.0.0.1:8080 HOST) and give http://127.0.0.1:8080"
            )
        self.host, self.port = parts.hostname, parts.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.model = model

    def _connect(self) -> tuple[http.client.HTTPConnection, dict]:
        """The connection for one request and what its reply adds about it: here a new one,
        opened by its request (bench/gateway.py's client opens and times it, or reuses one)."""
        return http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S), {}

    def _release(self, connection: http.client.HTTPConnection, finished: bool) -> None:
        """After a request (``finished``: its response was read to the end): closed here."""
        connection.close()

    def request(self, text: str, tokens: int) -> dict:
        """One streamed completion: seconds to the first token, the gaps between tokens, the
        tokens and the prompt tokens the server counted; ``error`` instead on failure."""
        body = {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        started = time.perf_counter()
        arrivals: list[float] = []
        usage: dict = {}
        connection, opened, finished = None, {}, False
        try:
            connection, opened = self._connect()
            connection.request("POST", "/v1/chat/completions", json.dumps(body), self.headers)
            response = connection.getresponse()
            if response.status != 200:
                return {"error": f"HTTP {response.status}: {response.read(300)!r}"}
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("content") or delta.get("reasoning_content"):
                        arrivals.append(time.perf_counter())
            finished = True
        except (OSError, ValueError, http.client.HTTPException) as error:
            return {"error": f"{type(error).__name__}: {error}"}
        finally:
            if connection is not None:
                self._release(connection, finished)
        if not arrivals:
            return {"error": "no token streamed"}
        return {
            "ttft_s": arrivals[0] - started,
            **opened,
            "gaps_s": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
            "tokens": usage.get("completion_tokens", len(arrivals)),
            "prompt_tokens": usage.get("prompt_tokens"),
            "seconds": time.perf_counter() - started,
        }


def served(client: Client, clients: int, rounds: int, tokens: int, words: int, bound: float):
    """``rounds`` rounds of ``clients`` requests started together; stops early (saying so)
    once ``bound`` seconds have passed."""
    deadline = time.monotonic() + bound
    round_rates, ttfts, gaps, errors, prompt_tokens = [], [], [], [], []
    serial = 0
    with ThreadPoolExecutor(max_workers=clients) as pool:
        for _ in range(rounds):
            if time.monotonic() > deadline:
                break
            texts = [prompt(serial + n, words) for n in range(clients)]
            serial += clients
            started = time.perf_counter()
            replies = list(pool.map(lambda text: client.request(text, tokens), texts))
            wall = time.perf_counter() - started
            good = [reply for reply in replies if "error" not in reply]
            errors += [reply["error"] for reply in replies if "error" in reply]
            if len(good) == clients:
                round_rates.append(sum(reply["tokens"] for reply in good) / wall)
            for reply in good:
                ttfts.append(reply["ttft_s"])
                gaps.extend(reply["gaps_s"])
                if reply["prompt_tokens"]:
                    prompt_tokens.append(reply["prompt_tokens"])
    return {
        "clients": clients,
        "rounds": len(round_rates),
        "aggregate_tps": statistics.median(round_rates) if round_rates else None,
        "round_tps": [round(rate, 2) for rate in round_rates],
        "ttft_ms": _ms(ttfts),
        "itl_ms": _ms(gaps),
        "requests": len(ttfts) + len(errors),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "prompt_tokens": statistics.median(prompt_tokens) if prompt_tokens else None,
    }


def _ms(seconds: list[float]) -> dict:
    p50, p95 = percentile(seconds, 0.5), percentile(seconds, 0.95)
    return {
        "p50": round(p50 * 1000, 2) if p50 is not None else None,
        "p95": round(p95 * 1000, 2) if p95 is not None else None,
    }


def ceiling_rows(jsonl: str) -> dict[int, dict]:
    """llama-batched-bench's jsonl lines by batch size ``pl``, with the end-to-end output rate
    of the batch (``output_tps``: pl x tg over the prompt and generation time)."""
    rows = {}
    for line in jsonl.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        row["output_tps"] = row["pl"] * row["tg"] / row["t"] if row["t"] > 0 else None
        rows[row["pl"]] = row
    return rows


def batched_bench(command: str, prompt_tokens: int, tokens: int, clients: list[int]) -> str:
    argv = shlex.split(command) + [
        "-npp", str(prompt_tokens), "-ntg", str(tokens),
        "-npl", ",".join(map(str, clients)), "--output-format", "jsonl",
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S * 2)
    if result.returncode:
        raise SystemExit(f"llama-batched-bench failed: {result.stderr[-2000:]}")
    return result.stdout + result.stderr  # it logs its rows on stderr


def table(results: list[dict]) -> str:
    lines = [
        f"{'K':>3} {'served t/s':>11} {'ceiling t/s':>12} {'ratio':>6} {'TTFT p50/p95 ms':>17}"
        f" {'ITL p50/p95 ms':>16} {'errors':>7}"
    ]
    for row in results:
        served_tps = row["aggregate_tps"]
        ceiling = row.get("ceiling_tps")
        ratio = f"{row['ratio']:.0%}" if row.get("ratio") is not None else "-"
        lines.append(
            f"{row['clients']:>3} {served_tps or 0:>11.1f} "
            + (f"{ceiling:>12.1f}" if ceiling else f"{'-':>12}")
            + f" {ratio:>6} {row['ttft_ms']['p50'] or 0:>8.1f}/{row['ttft_ms']['p95'] or 0:<8.1f}"
            f" {row['itl_ms']['p50'] or 0:>7.1f}/{row['itl_ms']['p95'] or 0:<8.1f}"
            f" {row['errors']:>7}"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ks = [row["clients"] for row in results]
    figure, (speed, latency) = plt.subplots(1, 2, figsize=(10, 4))
    speed.plot(ks, [row["aggregate_tps"] for row in results], "o-", label="served")
    if any(row.get("ceiling_tps") for row in results):
        speed.plot(ks, [row.get("ceiling_tps") for row in results], "s--", label="ceiling")
    speed.set(xlabel="clients at once (K)", ylabel="output tokens/s", xscale="log", title=title)
    speed.legend()
    latency.plot(ks, [row["itl_ms"]["p95"] for row in results], "o-", label="p95 inter-token")
    latency.plot(ks, [row["ttft_ms"]["p95"] for row in results], "s-", label="p95 first token")
    latency.set(xlabel="clients at once (K)", ylabel="ms", xscale="log", yscale="log")
    latency.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


def _clients(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(1 <= value <= 256 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: client counts from 1 to 256, e.g. 1,2,4")
    return sorted(set(values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--api-key-file", type=Path, help="a file holding the server's API key")
    parser.add_argument("--model", help="the model name to send (server.alias)")
    parser.add_argument("--clients", type=_clients, default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bound", type=float, default=300, help="seconds per K at most")
    parser.add_argument("--batched-bench", help="llama-batched-bench command (-m, -c, ...)")
    parser.add_argument("--ceiling-jsonl", type=Path, help="its jsonl output, run elsewhere")
    parser.add_argument("--out", type=Path, default=Path("load.json"))
    parser.add_argument("--plot", type=Path, help="a PNG of tokens/s and p95 latency per K")
    parser.add_argument("--title", default="served against llama-batched-bench")
    args = parser.parse_args(argv)
    if not 1 <= args.tokens <= 4096 or not 1 <= args.rounds <= 100 or args.prompt_words < 1:
        parser.error("--tokens 1..4096, --rounds 1..100, --prompt-words >= 1")
    api_key = args.api_key_file.read_text().strip() if args.api_key_file else None
    client = Client(args.url, api_key, args.model)
    # The warm-up loads the caches and counts the prompt's tokens; a server still loading its
    # model answers 503 until it is ready, which is waited for within the bound.
    deadline = time.monotonic() + args.bound
    warm = client.request(prompt(-1, args.prompt_words), 4)
    while warm.get("error", "").startswith("HTTP 503") and time.monotonic() < deadline:
        time.sleep(1)
        warm = client.request(prompt(-1, args.prompt_words), 4)
    if "error" in warm:
        print(f"bench.load: {args.url} did not answer: {warm['error']}", file=sys.stderr)
        return 2
    results = []
    for clients in args.clients:
        row = served(client, clients, args.rounds, args.tokens, args.prompt_words, args.bound)
        results.append(row)
        print(f"K={clients}: {row['aggregate_tps'] or 0:.1f} tokens/s", flush=True)
    prompt_tokens = warm["prompt_tokens"] or args.prompt_words
    ceiling_text = None
    if args.batched_bench:
        ceiling_text = batched_bench(args.batched_bench, prompt_tokens, args.tokens, args.clients)
    elif args.ceiling_jsonl:
        ceiling_text = args.ceiling_jsonl.read_text()
    ceiling = ceiling_rows(ceiling_text) if ceiling_text else {}
    for row in results:
        found = ceiling.get(row["clients"])
        row["ceiling_tps"] = found["output_tps"] if found else None
        row["ceiling_tg_tps"] = found["speed_tg"] if found else None
        ratio = (
            row["aggregate_tps"]
            and row["ceiling_tps"]
            and row["aggregate_tps"] / row["ceiling_tps"]
        )
        row["ratio"] = round(ratio, 3) if ratio else None
    report = {
        "url": args.url,
        "model": args.model,
        "prompt_tokens": prompt_tokens,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "results": results,
        "ceiling": list(ceiling.values()),
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(table(results))
    if args.plot and plot(results, args.plot, args.title):
        print(f"plot: {args.plot}")
    return 0 if all(row["errors"] == 0 for row in results) else 1


if __name__ == "__main__":
    sys.exit(main())
