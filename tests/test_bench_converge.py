"""bench/converge.py's pure parts and llamarig_sandbox/bigmodel.py, without a sandbox: the sizes
it takes, the A/B order, medians and ratio, the commands counted from a pyinfra debug log, the
table and the RESULTS.md section, the inotify open counter on real files, the padded model."""

import argparse
import hashlib
import shutil
import subprocess

import pytest

from bench import converge
from llamarig.config import load_inventory
from llamarig_sandbox import bigmodel

# The shape of `pyinfra --debug` on stderr (pyinfra_cli/log.py LogFormatter: the module in
# brackets, four spaces; headers with "-->"; a command may span lines), as a converge logs it.
DEBUG_LOG = """\
--> Loading config...
    [pyinfra.api.state] Activating host: sandbox-bench
    [pyinfra.connectors.ssh] Connecting to: 127.0.0.1 ({'port': 2236})
--> Gathering facts...
    [pyinfra.api.facts] Getting fact: llamarig.facts.files.FileSha256 (path=/srv/m.gguf)
    [pyinfra.connectors.ssh] Running command on sandbox-bench: (pty=False) sh -c 'if [ -f \
/srv/m.gguf ]; then sha256sum < /srv/m.gguf; fi'
    [pyinfra.connectors.ssh] Waiting for exit status...
    [pyinfra.connectors.ssh] Command exit status: 0
    \x1b[32m[pyinfra.connectors.ssh] Running command on sandbox-bench: (pty=False) sh -c 'cat \
<<EOF
sha256sum is only named in this heredoc
EOF'\x1b[0m
    [pyinfra.connectors.ssh] Command exit status: 0
    [pyinfra.connectors.ssh] Attempting upload of <_io.StringIO> to /etc/x
    [pyinfra.connectors.ssh] Running command on sandbox-bench: (pty=False) sh -c 'uname -r'
    [pyinfra.connectors.ssh] Command exit status: 0
    [pyinfra.api.operation] Running command: not from a connector, not counted sha256sum
--> Disconnecting from hosts...
"""


def measured(size_gib=4.0, noop=(3.0, 1.0, 2.0), bare=(1.0, 1.0, 4.0)):
    return {
        "size_gib": size_gib,
        "noop_s": list(noop),
        "bare_s": list(bare),
        "converge_s": 30.0,
        "allocated_mib": 94,
        "commands": 41,
        "bare_commands": 3,
        "naming_sha256sum": 2,
        "sha256sum_runs": 2,
        "model_opens": 2,
    }


class TestSizesAndOrder:
    def test_sizes_are_gib_above_zero(self):
        assert converge.parse_sizes("0.1,4,16") == [0.1, 4.0, 16.0]
        assert converge.size_bytes(16) == 16 * 2**30
        assert converge.size_bytes(0.1) == 107_374_182
        for bad in ("", "0", "4,-1", "four"):
            with pytest.raises(argparse.ArgumentTypeError, match="--sizes"):
                converge.parse_sizes(bad)

    def test_pairs_alternate_which_runs_first(self):
        order = converge.alternation(5)
        assert [pair[0] for pair in order] == ["noop", "bare", "noop", "bare", "noop"]
        assert all(sorted(pair) == ["bare", "noop"] for pair in order)

    def test_ratio_is_of_the_medians(self):
        assert converge.ratio([3.0, 1.0, 2.0], [1.0, 1.0, 4.0]) == 2.0
        medians = (1.25, 0.75)  # an even count: the mean of the middle two
        expected = medians[0] / medians[1]
        assert converge.ratio([9.0, 0.5, 1.0, 1.5], [1.0, 0.5, 0.5, 9.0]) == pytest.approx(expected)


class TestCommandCount:
    def test_counts_the_connectors_commands_and_uploads(self):
        counted = converge.count_commands(DEBUG_LOG)
        assert counted.commands == 3
        assert counted.uploads == 1
        assert counted.naming_sha256sum == 2
        assert counted.command_lines == (
            "sh -c 'if [ -f /srv/m.gguf ]; then sha256sum < /srv/m.gguf; fi'",
            "sh -c 'cat <<EOF",
            "sh -c 'uname -r'",
        )

    def test_a_log_without_commands_counts_none(self):
        counted = converge.count_commands("--> Loading config...\n    [pyinfra.api.state] x\n")
        assert (counted.commands, counted.uploads, counted.naming_sha256sum) == (0, 0, 0)


class TestTable:
    def test_a_row_holds_medians_ratio_and_verdict(self):
        row = converge.size_row(measured())
        assert (row["noop_median_s"], row["bare_median_s"], row["ratio"]) == (2.0, 1.0, 2.0)
        assert row["within"] is True
        slow = converge.size_row(measured(size_gib=16, noop=(90.0, 95.0, 91.0)))
        assert slow["ratio"] == 91.0 and slow["within"] is False

    def test_table_and_summary_name_each_size(self):
        rows = [converge.size_row(measured(0.1)), converge.size_row(measured(16, noop=(5,) * 3))]
        table = converge.markdown_table(rows).splitlines()
        assert len(table) == 4
        assert table[2].startswith("| 0.1 GiB | 2.00 | 1.00 | 2.00x | yes | 41 / 3 | 2 | 2 | 2 |")
        assert "| 16 GiB | 5.00 | 1.00 | 5.00x | NO |" in table[3]
        assert converge.summary_line(rows) == (
            "no-op converge / bare connection: 0.1 GiB 2.00x, 16 GiB 5.00x: NOT all within 2x"
        )
        assert converge.summary_line(rows[:1]).endswith(": all within 2x")

    def test_the_section_carries_the_run(self):
        results = {
            "meta": {
                "started": "2026-12-01T14:00:00+00:00",
                "finished": "2026-12-01T14:20:00+00:00",
                "commit": "abc123def456",
                "machine": "2 x AMD EPYC",
                "versions": "pyinfra 3.10",
            },
            "runs": 3,
            "sizes": [measured(0.1, noop=(1.5, 1.25, 1.75))],
        }
        section = converge.markdown(results)
        assert "`abc123def456`" in section and "2 x AMD EPYC" in section
        assert "- 0.1 GiB: no-op 1.50, 1.25, 1.75 s; bare 1.00, 1.00, 4.00 s" in section
        assert "0.1 GiB 1.50x: all within 2x." in section

    def test_the_section_is_appended_once_then_replaced(self):
        document = "# Results\n\n## GPU\n\ntext\n"
        first = converge.replace_section(document, "## Converge\n\nold\n")
        assert first.startswith(document.rstrip("\n") + "\n\n" + converge.SECTION_BEGIN)
        later = converge.replace_section(first + "\n## After\n", "## Converge\n\nnew\n")
        assert "old" not in later and "new" in later and later.endswith("## After\n")
        assert later.count(converge.SECTION_BEGIN) == 1
        assert converge.replace_section(later, "## Converge\n\nnew\n") == later


class TestOpenCounter:
    def test_counts_opens_and_execs_of_each_file(self, tmp_path):
        data, program = tmp_path / "model.gguf", tmp_path / "true"
        data.write_bytes(b"x" * 4096)
        shutil.copy2(shutil.which("true"), program)
        counter = converge.OpenCounter({"model": data, "program": program})
        try:
            assert counter.take() == {"model": 0, "program": 0}
            for _ in range(3):
                data.read_bytes()
            data.stat()  # a stat opens nothing
            subprocess.run([program], check=True)
            subprocess.run(["sh", "-c", f"{program}; {program}"], check=True)
            assert counter.take() == {"model": 3, "program": 3}
            assert counter.take() == {"model": 0, "program": 0}
        finally:
            counter.close()


class TestInventory:
    def test_the_bench_rig_serves_the_file_on_the_host(self, tmp_path):
        path = converge.write_inventory(
            tmp_path, str(tmp_path / "known_hosts"), "/srv/llamarig-bench/m-1.gguf", "a" * 64
        )
        rig = load_inventory(path).hosts[converge.NAME].data
        assert rig["model"]["path"] == "/srv/llamarig-bench/m-1.gguf"
        assert rig["model"]["sha256"] == "a" * 64 and not rig["model"]["url"]
        assert rig["ssh"]["port"] == converge.SSH_PORT
        assert rig["server"]["port"] == converge.SERVER_PORT


class TestPaddedModel:
    def test_the_padded_file_is_sparse_and_its_digest_is_right(self, tmp_path):
        source = tmp_path / "source.gguf"
        source.write_bytes(bytes(range(256)) * 64)
        size = (1 << 26) + 3  # not a whole number of the digest's chunks
        dest = tmp_path / "root" / "srv" / "padded.gguf"
        bigmodel.place_padded(source, dest, size)
        assert dest.stat().st_size == size
        assert dest.read_bytes()[: source.stat().st_size] == source.read_bytes()
        assert bigmodel.allocated_bytes(dest) < size // 8
        digest = bigmodel.padded_sha256(source, size, cache_dir=tmp_path / "cache")
        assert digest == hashlib.sha256(dest.read_bytes()).hexdigest()

    def test_the_digest_is_cached_by_source_and_size(self, tmp_path):
        source = tmp_path / "source.gguf"
        source.write_bytes(b"gguf")
        cache = tmp_path / "cache"
        digest = bigmodel.padded_sha256(source, 100, cache_dir=cache)
        assert digest == hashlib.sha256(b"gguf" + bytes(96)).hexdigest()
        (cached,) = cache.iterdir()
        assert cached.name == f"{hashlib.sha256(b'gguf').hexdigest()}-100.sha256"
        cached.write_text("f" * 64 + "\n")  # what the cache says is what is returned
        assert bigmodel.padded_sha256(source, 100, cache_dir=cache) == "f" * 64
        assert bigmodel.padded_sha256(source, 101, cache_dir=cache) != "f" * 64

    def test_a_size_below_the_source_is_refused(self, tmp_path):
        source = tmp_path / "source.gguf"
        source.write_bytes(b"gguf")
        with pytest.raises(ValueError, match="smaller than"):
            bigmodel.padded_sha256(source, 3, cache_dir=tmp_path / "cache")
