"""bench/report.py: the verdicts it prints are computed from the measurements (a synthetic
results file here; the real one comes from bench/gpu_bench.py on the GPU machine)."""

import json

from bench import report


def sweep_row(label, sm, ts, avg, fits=True, nccl=True):
    return {"label": label, "sm": sm, "ts": ts, "nccl": nccl, "avg_ts": avg, "stddev_ts": 0.5,
            "peak_mib": [1000, 1000], "fits_mixed_caps": fits}  # fmt: skip


def results(tensor_11=96.0, server=95.0, measured=(21000, 21000)):
    plan = {"split_mode": "tensor", "tensor_split": [0.5, 0.5], "ctx": 32768,
            "planned_mib": [20098, 20098], "buffers_mib": [18562, 18562],
            "caps_mib": [143771, 143771]}  # fmt: skip
    mixed_plan = dict(plan, tensor_split=[0.623, 0.378], caps_mib=[24576, 16303])
    rows = [
        sweep_row("none (1 GPU)", "none", None, 72.0, fits=False),
        sweep_row("tensor 1:1", "tensor", "1/1", tensor_11, fits=False),
        sweep_row("tensor 3:2", "tensor", "3/2", 80.0),
        sweep_row("tensor 0.623:0.378", "tensor", "0.623/0.378", 79.0),
    ]
    error = [
        round(100 * (p - m) / m, 2) for p, m in zip(plan["planned_mib"], measured, strict=True)
    ]
    return {
        "sweep": {"llama-32b-q8_0": rows, "llama-8b-q8_0": []},
        "decode_bytes": {"llama-32b-q8_0": 34 * 2**30},
        "bandwidth_gbs": [4000.0, 4000.0],
        "servers": {
            "32b-planned": {
                "model": "m",
                "plan": plan,
                "decode_median_greedy": server,
                "decode_median_default": server - 5,
                "memory_used_mib": list(measured),
                "memory_error_pct": error,
                "overhead_mib": [0, 0],
                "under_caps": True,
                "verify": {"rc": 0, "summary": "20 passed"},
            },  # fmt: skip
            "32b-mixed": {
                "model": "m",
                "plan": mixed_plan,
                "decode_median_greedy": 78.0,
                "decode_median_default": 70.0,
                "memory_used_mib": [24000, 16400],
                "memory_error_pct": [0, 0],
                "overhead_mib": [0, 0],
                "under_caps": False,
                "verify": {"rc": 0, "summary": "ok"},
            },  # fmt: skip
        },
    }


def test_verdicts_follow_the_numbers():
    good = "\n".join(report.verdicts(results()))
    assert "32b uncapped: planned `tensor 1:1` 96.0 t/s, fastest that fits `tensor 1:1`" in good
    assert "(within 3%)" in good
    # Under the caps only the rows that fit compete: 3:2 (80) beats the planned ratio (79).
    assert "32b mixed caps: planned `tensor 0.623:0.378` 79.0 t/s, fastest that fits " in good
    assert "98.8%" in good
    assert "server 32b-planned: 95.0 t/s (greedy), llama-bench `tensor 1:1` 96.0 t/s: 99.0%" in good
    assert "OVER THE CAPS" in good

    slow = "\n".join(report.verdicts(results(tensor_11=60.0, server=50.0, measured=(16000,) * 2)))
    assert "fastest that fits `tensor 3:2` 80.0 t/s: 75.0% (NOT within 3%)" in slow
    assert "BELOW 95%" in slow
    assert "worst error 25.6% (NOT within 10%)" in slow


def test_report_writes_markdown_and_plot(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results()))
    assert report.main([str(path), str(tmp_path)]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| tensor 1:1 | True | 96.0 |" in text
    assert (tmp_path / "decode.png").stat().st_size > 10_000


def test_report_adds_the_server_overhead_table(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(results()))
    overhead = {
        "started": "s",
        "finished": "f",
        "server": {
            "8b as planned": {"greedy": 200.0, "default": 198.0},
            "8b -t 1": {"error": "exited 1"},
        },
        "bench": {"8b": {"1": 240.0, "32": 250.0}},
    }
    (tmp_path / "overhead.json").write_text(json.dumps(overhead))
    assert report.main([str(tmp_path / "results.json"), str(tmp_path)]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    # 1000/200 - 1000/250 = 1.00 ms per token added, against the faster llama-bench row.
    assert "| 8b | `as planned` | 200.0 | 198.0 | 240.0 / 250.0 | 80.0% | 1.00 |" in text
    assert "| 8b | `-t 1` | failed: exited 1 |" in text
