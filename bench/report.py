"""Turn bench/gpu_bench.py's results.json into RESULTS.md and decode.png.

python3 bench/report.py RESULTS_JSON OUT_DIR   (overhead.json beside RESULTS_JSON is added)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Which sweep row is the same configuration as each deployed server.
SERVER_SWEEP_ROW = {
    "32b-planned": ("llama-32b-q8_0", "tensor 1:1"),
    "8b-planned": ("llama-8b-q8_0", "tensor 1:1"),
    "8b-single": ("llama-8b-q8_0", "none (1 GPU)"),
}
PLANNER_WITHIN = 0.03
SERVER_AT_LEAST = 0.95
MEMORY_WITHIN_PCT = 10


def roofline_tps(row: dict, decode_bytes: int, bandwidth_gbs: float) -> float:
    """Decode ceiling: the bytes the busiest GPU reads per token over its copy bandwidth."""
    if row["sm"] == "tensor":
        shares = [float(x) for x in row["ts"].split("/")]
        busiest = max(shares) / sum(shares)
    else:  # one GPU, or a pipeline: every byte passes one GPU's memory at a time
        busiest = 1.0
    return bandwidth_gbs * 1e9 / (decode_bytes * busiest)


def _speed(entry: dict, sampling: str) -> str:
    speed = entry.get(f"decode_median_{sampling}")
    if speed is None and sampling == "default" and "decode_median_greedy" not in entry:
        speed = entry.get("decode_median")  # runs before the greedy column
    return f"{speed:.1f}" if speed is not None else "-"


def mixed_row_label(results: dict) -> str | None:
    plan = results.get("servers", {}).get("32b-mixed", {}).get("plan")
    if not plan:
        return None
    return "tensor " + ":".join(f"{share:g}" for share in plan["tensor_split"])


def verdicts(results: dict) -> list[str]:
    """The issue's three claims, each with its numbers."""
    lines = []
    sweep = results.get("sweep", {})
    servers = results.get("servers", {})
    mixed_label = mixed_row_label(results)
    planned_rows = {
        "32b uncapped": ("llama-32b-q8_0", "tensor 1:1", lambda row: True),
        "8b uncapped": ("llama-8b-q8_0", "tensor 1:1", lambda row: True),
        "32b mixed caps": (
            "llama-32b-q8_0",
            mixed_label,
            lambda row: row.get("fits_mixed_caps", False),
        ),
    }
    for name, (model, label, fits) in planned_rows.items():
        rows = [row for row in sweep.get(model, []) if "avg_ts" in row and fits(row)]
        planned = next((row for row in rows if row["label"] == label), None)
        if not rows or planned is None:
            lines.append(f"- planner, {name}: not measured")
            continue
        best = max(rows, key=lambda row: row["avg_ts"])
        ratio = planned["avg_ts"] / best["avg_ts"]
        ok = ratio >= 1 - PLANNER_WITHIN
        lines.append(
            f"- planner, {name}: planned `{label}` {planned['avg_ts']:.1f} t/s, fastest that "
            f"fits `{best['label']}` {best['avg_ts']:.1f} t/s: {100 * ratio:.1f}% "
            f"({'within' if ok else 'NOT within'} {100 * PLANNER_WITHIN:.0f}%)"
        )
    server_rows = dict(SERVER_SWEEP_ROW)
    if mixed_label:
        server_rows["32b-mixed"] = ("llama-32b-q8_0", mixed_label)
    for server, (model, label) in server_rows.items():
        entry = servers.get(server, {})
        row = next((r for r in sweep.get(model, []) if r["label"] == label and "avg_ts" in r), None)
        if "decode_median_greedy" not in entry or row is None:
            lines.append(f"- server {server} vs llama-bench: not measured")
            continue
        ratio = entry["decode_median_greedy"] / row["avg_ts"]
        lines.append(
            f"- server {server}: {entry['decode_median_greedy']:.1f} t/s (greedy), "
            f"llama-bench `{label}` "
            f"{row['avg_ts']:.1f} t/s: {100 * ratio:.1f}% "
            f"({'at least' if ratio >= SERVER_AT_LEAST else 'BELOW'} {100 * SERVER_AT_LEAST:.0f}%)"
        )
    for server, entry in servers.items():
        if "memory_error_pct" not in entry:
            continue
        worst = max(abs(e) for e in entry["memory_error_pct"][: len(entry["plan"]["planned_mib"])])
        lines.append(
            f"- memory {server}: planned {entry['plan']['planned_mib']} MiB, measured "
            f"{entry['memory_used_mib']} MiB, worst error {worst:.1f}% "
            f"({'within' if worst <= MEMORY_WITHIN_PCT else 'NOT within'} {MEMORY_WITHIN_PCT}%)"
            + ("" if entry.get("under_caps", True) else "; OVER THE CAPS")
        )
    return lines


def markdown(results: dict, overhead: dict | None = None) -> str:
    machine = results.get("machine", {})
    bandwidth = results.get("bandwidth_gbs") or [0.0]
    out = [
        "# GPU benchmark: llamarig's planned rig against every split on two H200s",
        "",
        f"Run {results.get('started')} - {results.get('finished', 'unfinished')}, llama.cpp "
        f"`{results.get('commit', '?')[:12]}`, {machine.get('nvcc', '')}, "
        f"{machine.get('cpus')} CPUs.",
        "",
        "```",
        machine.get("gpus", ""),
        "```",
        "",
        "Re-run on the GPU machine (through the device tool, `.carry/llama.cpp.git` and `.whl` "
        "carried): `bash bench/run.sh`. Models are random-weight Llama-shaped Q8_0 "
        "(bench/models.py); decode is measured with a fixed prompt, 128 tokens, "
        "5 repetitions (median of `timings.predicted_per_second` through the deployed server; "
        "`llama-bench -fa 1 -ctk q8_0 -ctv q8_0 -b 2048 -ub 512 -p 0 -n 128 -r 3` for the "
        "sweep).",
        "",
        "## Verdicts",
        "",
        *verdicts(results),
        "",
        "## Deploy and build",
        "",
    ]
    first, second = results.get("deploy_first", {}), results.get("deploy_second", {})
    build = results.get("build", {})
    out += [
        f"- first deploy (`pyinfra -y inventory.py deploy.py`, @local, "
        f"RIG_INVENTORY=inventory/gpu-h200x2.yml): {first.get('seconds')} s, "
        f"{first.get('changed')} operations changed",
        f"- second deploy: {second.get('seconds')} s, {second.get('changed')} changed "
        f"{second.get('changed_ops') or ''}",
        f"- build (configure to finish, `llama-server` + `llama-bench`, NCCL, "
        f"`{results.get('cuda_architectures') or ';'.join(build.get('architectures', []))}`): "
        f"{build.get('seconds')} s; no-NCCL `llama-bench` "
        f"(90-real) built alongside in {results.get('no_nccl_build_seconds')} s",
        f"- `cuobjdump --list-elf libggml-cuda.so`: architectures {build.get('architectures')}; "
        f"NCCL linked: {build.get('nccl_linked')}",
        f"- device-to-device copy bandwidth per GPU: {bandwidth} GB/s (read + write)",
        "",
        "## Deployed server (`llamarig run`)",
        "",
        "Medians of 5 completions of 128 tokens each; `default` is the server's sampler chain at "
        "temperature 0, `greedy` asks for top-k 1 only (llama-bench samples nothing, so that is "
        "the like-for-like comparison below).",
        "",
        "| rig | model | split | ctx | decode t/s, default sampling | decode t/s, greedy | "
        "planned MiB/GPU | measured MiB/GPU | error % | overhead beyond buffers MiB | caps | "
        "verify |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, entry in results.get("servers", {}).items():
        if "error" in entry:
            out.append(f"| {label} | | | | failed: {entry['error'][:200]} | | | | | | | |")
            continue
        plan = entry["plan"]
        caps = plan["caps_mib"] if "mixed" in label else "-"
        verify = entry.get("verify", {})
        verify_line = verify.get("summary", "").splitlines()[-1:] or [""]
        out.append(
            f"| {label} | {entry['model']} | {plan['split_mode']} {plan['tensor_split']} | "
            f"{plan['ctx']} | {_speed(entry, 'default')} | {_speed(entry, 'greedy')} | "
            f"{plan['planned_mib']} | "
            f"{entry['memory_used_mib']} | {entry['memory_error_pct']} | "
            f"{entry['overhead_mib']} | {caps} | rc {verify.get('rc')}: {verify_line[0]} |"
        )
    for model, rows in results.get("sweep", {}).items():
        decode_bytes = decode_bytes_of(results, model)
        out += [
            "",
            f"## Sweep: {model}"
            + (f" ({decode_bytes / 2**30:.2f} GiB read per token)" if decode_bytes else ""),
            "",
            "| configuration | NCCL | t/s | +- | roofline t/s | of roofline | peak MiB/GPU | "
            "fits mixed caps |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            if "avg_ts" not in row:
                out.append(f"| {row['label']} | {row['nccl']} | failed: {row.get('error')} |||||")
                continue
            roof = roofline_tps(row, decode_bytes, min(bandwidth)) if decode_bytes else 0
            out.append(
                f"| {row['label']} | {row['nccl']} | {row['avg_ts']:.1f} | "
                f"{row['stddev_ts']:.1f} | {roof:.0f} | {row['avg_ts'] / roof:.0%} | "
                f"{row['peak_mib']} | {row.get('fits_mixed_caps', '-')} |"
                if roof
                else f"| {row['label']} | {row['nccl']} | {row['avg_ts']:.1f} | | | | | |"
            )
    out += [
        "",
        "Roofline: the weight bytes one token reads (every tensor but the token embedding, which "
        "llama.cpp keeps in host memory) over the measured copy bandwidth, for the GPU that reads "
        "the most (all of it for `none` and `layer`, the largest share in tensor mode). It "
        "ignores the KV cache (tiny at 128 tokens) and the all-reduce.",
    ]
    if overhead:
        out += overhead_section(overhead)
    return "\n".join(out) + "\n"


def overhead_section(overhead: dict) -> list[str]:
    """bench/server_overhead.py's table: the 8B server with flags added, against llama-bench at
    the same split, and the time per token the server adds."""
    out = [
        "",
        "## Server against llama-bench: what the gap is made of",
        "",
        (
            f"Run {overhead['started']} - {overhead.get('finished', 'unfinished')}"
            if "started" in overhead
            else "Run times not recorded (the script's first version)"
        )
        + " (`bench/server_overhead.py`, its own machine): the deployed 8B server as planned and "
        "with flags added through `llamarig run -- FLAGS`, each a fresh server process, "
        "medians of 5 completions; llama-bench with the same split at 1 and 32 threads.",
        "",
        "| rig | flags added | server t/s, greedy | server t/s, default | llama-bench t/s "
        "(-t 1 / -t 32) | server / llama-bench | ms per token added |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, entry in overhead.get("server", {}).items():
        rig, _, flags = label.partition(" ")
        bench = overhead.get("bench", {}).get(rig, {})
        if "error" in entry or not bench:
            out.append(f"| {rig} | `{flags}` | failed: {entry.get('error')} |||||")
            continue
        fastest = max(v for v in bench.values() if isinstance(v, int | float))
        added = 1000 / entry["greedy"] - 1000 / fastest
        out.append(
            f"| {rig} | `{flags}` | {entry['greedy']:.1f} | {entry['default']:.1f} | "
            f"{bench.get('1')} / {bench.get('32')} | {entry['greedy'] / fastest:.1%} | "
            f"{added:.2f} |"
        )
    return out


def decode_bytes_of(results: dict, model: str) -> int | None:
    """Bytes read per token: measured from the header by the run, else from the model's shape
    (bench/models.py writes exactly these tensors, with Llama 3's 128256-token vocabulary)."""
    measured = results.get("decode_bytes", {}).get(model)
    if measured:
        return measured
    from bench.models import SHAPES, tensor_bytes, tensor_shapes

    shape = SHAPES.get(model.removesuffix("-q8_0"))
    if shape is None:
        return None
    return sum(
        tensor_bytes(dims)
        for tensor, dims in tensor_shapes(shape, 128256)
        if tensor != "token_embd.weight"
    )


def server_rows(results: dict) -> dict[str, list[dict]]:
    """The deployed servers' decode speeds as rows like the sweep's, per model."""
    rows: dict[str, list[dict]] = {}
    for label, entry in results.get("servers", {}).items():
        if "plan" not in entry:
            continue
        plan = entry["plan"]
        ts = "/".join(f"{share:g}" for share in plan["tensor_split"] or [1])
        model = entry["model"].removesuffix(".gguf")
        for sampling in ("default", "greedy"):
            speed = entry.get(f"decode_median_{sampling}")
            if speed is None and sampling == "default":
                speed = entry.get("decode_median")
            if speed is not None:
                rows.setdefault(model, []).append(
                    {
                        "label": f"server {label} ({sampling})",
                        "sm": plan["split_mode"],
                        "ts": ts,
                        "avg_ts": speed,
                        "server": True,
                    }  # fmt: skip
                )
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = server_rows(results)
    models = list(dict.fromkeys([*results.get("sweep", {}), *served]))
    bandwidth = min(results.get("bandwidth_gbs") or [0.0])
    figure, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5), squeeze=False)
    for axis, model in zip(axes[0], models, strict=False):
        rows = [row for row in results.get("sweep", {}).get(model, []) if "avg_ts" in row]
        rows += served.get(model, [])
        labels = [row["label"] + ("*" if row.get("nccl") is False else "") for row in rows]
        speeds = [row["avg_ts"] for row in rows]
        colors = ["tab:green" if row.get("server") else "tab:blue" for row in rows]
        bars = axis.bar(range(len(rows)), speeds, color=colors)
        decode_bytes = decode_bytes_of(results, model)
        for index, row in enumerate(rows):
            if decode_bytes and bandwidth:
                roof = roofline_tps(row, decode_bytes, bandwidth)
                axis.plot([index - 0.4, index + 0.4], [roof, roof], color="tab:red")
        for bar, speed in zip(bars, speeds, strict=False):
            axis.text(bar.get_x() + bar.get_width() / 2, speed, f"{speed:.0f}", ha="center",
                      va="bottom", fontsize=8)  # fmt: skip
        axis.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=8)
        axis.set_ylabel("decode tokens/s (128 tokens)")
        axis.set_title(
            f"{model}: blue llama-bench, green deployed server,\nred = memory-bandwidth "
            "roofline; * = no NCCL",
            fontsize=9,
        )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    results = json.loads(Path(argv[0]).read_text())
    overhead_file = Path(argv[0]).with_name("overhead.json")
    overhead = json.loads(overhead_file.read_text()) if overhead_file.exists() else None
    out_dir = Path(argv[1])
    (out_dir / "RESULTS.md").write_text(markdown(results, overhead))
    if results.get("sweep") or server_rows(results):
        plot(results, out_dir / "decode.png")
    print("\n".join(verdicts(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
