"""bench/load.py's arithmetic without a server: percentiles, llama-batched-bench's jsonl rows
(a line of the pinned build's output format) and refused arguments. Its run against the real
sandbox server is in test_sandbox_converge."""

from __future__ import annotations

import pytest

from bench import load
from llamarig.serving.throughput import percentile

# Two rows as the pinned llama-batched-bench prints them with --output-format jsonl, between
# its log lines.
BATCHED_BENCH_OUTPUT = """\
main: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 120, "tg": 64, "pl": 1, \
"n_kv": 184, "t_pp": 0.400000, "speed_pp": 300.000000, "t_tg": 0.800000, "speed_tg": 80.000000, \
"t": 1.200000, "speed": 153.333333}
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 120, "tg": 64, "pl": 2, \
"n_kv": 368, "t_pp": 0.600000, "speed_pp": 400.000000, "t_tg": 1.000000, "speed_tg": 128.000000, \
"t": 1.600000, "speed": 230.000000}

llama_perf_context_print: load time = 100.00 ms
"""


def test_ceiling_is_the_batch_output_rate_over_prompt_and_generation():
    rows = load.ceiling_rows(BATCHED_BENCH_OUTPUT)
    assert sorted(rows) == [1, 2]
    assert rows[1]["output_tps"] == pytest.approx(64 / 1.2)
    assert rows[2]["output_tps"] == pytest.approx(2 * 64 / 1.6)
    assert rows[2]["speed_tg"] == 128


def test_percentiles_are_nearest_rank():
    values = [float(n) for n in range(1, 101)]
    assert percentile(values, 0.5) == 50
    assert percentile(values, 0.95) == 95
    assert percentile([3.0], 0.95) == 3
    assert percentile([], 0.5) is None


def test_each_prompt_starts_differently_and_has_its_length():
    first, second = load.prompt(0, 100), load.prompt(1, 100)
    assert first.splitlines()[0] != second.splitlines()[0]
    assert len(first.splitlines()[1].split()) == 100


@pytest.mark.parametrize("bad", ["0", "1,x", "", "1,300"])
def test_client_counts_out_of_bounds_are_refused(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load.main(["--clients", bad])
    assert exit_info.value.code == 2
    assert "client counts from 1 to 256" in capsys.readouterr().err


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(SystemExit, match="is not an http:// URL"):
        load.Client("file:///etc/passwd", None, None)


@pytest.mark.parametrize("url", ["http://10.0.0.5:8080", "http://rig1:8080", "http://[::2]:80"])
def test_a_url_off_loopback_is_refused(url):
    with pytest.raises(SystemExit, match="is not a loopback address: reach a rig through a"):
        load.Client(url, None, None)


def test_loopback_urls_are_taken():
    for url in ("http://127.0.0.1:8080", "http://localhost:8080", "http://[::1]:8080"):
        assert load.Client(url, None, None).port == 8080
