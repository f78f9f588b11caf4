"""bench/fleet_build.py without a sandbox: the inventory of each arm, the alternation, what a
deploy's output says of its builds and whether an arm did what it says, the medians and the
ratio, the table and the RESULTS.md section; the CPU time it reads from /proc."""

import os
import subprocess
import sys
import time

import pytest
import yaml

from bench import fleet_build
from llamarig.config import load_inventory


class Info:
    def __init__(self, name):
        self.key_path = "/keys/id_ed25519"
        self.known_hosts_path = f"/kh/{name}"
        self.test_model_url = "http://127.0.0.1:8765/random.gguf"
        self.test_model_sha256 = "ab" * 32


INFOS = {name: Info(name) for name in fleet_build.NAMES}


@pytest.mark.parametrize("share", [True, False])
def test_the_inventory_has_both_rigs_on_their_ports_without_ccache(tmp_path, share):
    path = fleet_build.write_inventory(tmp_path / "fleet.yml", INFOS, share)
    hosts = yaml.safe_load(path.read_text())["all"]["children"]["rigs"]["hosts"]
    assert list(hosts) == ["sandbox-fbb-1", "sandbox-fbb-2"]  # the first of the key builds
    ports = (("sandbox-fbb-1", 2270, 8141), ("sandbox-fbb-2", 2271, 8142))
    for name, ssh_port, server_port in ports:
        rig = hosts[name]
        assert rig["ssh"] == {
            "host": "127.0.0.1",
            "port": ssh_port,
            "user": "root",
            "key": "/keys/id_ed25519",
            "known_hosts": f"/kh/{name}",
        }
        assert rig["server"]["port"] == server_port
        assert rig["server"]["threads"] == 1 and rig["server"]["max_slowdown"] is None
        assert rig["llama_cpp"]["ccache"] is False
        assert rig["llama_cpp"]["share_builds"] is share
        assert rig["llama_cpp"]["backend"] == "cpu" and rig["llama_cpp"]["targets"] == [
            "llama-server"
        ]
        assert rig["model"] == {"url": Info(name).test_model_url, "sha256": "ab" * 32}
        assert "expect" not in rig  # random weights answer nothing
    # The two rigs differ only in where they are reached: one build key when shared.
    one, two = (dict(hosts[name]) for name in fleet_build.NAMES)
    for rig in (one, two):
        rig.pop("ssh"), rig.pop("server")
    assert one == two


def test_the_inventory_is_one_the_deploy_loads(tmp_path):
    for share in (True, False):
        path = fleet_build.write_inventory(tmp_path / "fleet.yml", INFOS, share)
        hosts = load_inventory(path).hosts
        assert list(hosts) == list(fleet_build.NAMES)
        for name in fleet_build.NAMES:
            llama_cpp = hosts[name].data["llama_cpp"]
            assert llama_cpp["share_builds"] is share and llama_cpp["ccache"] is False


def test_the_arms_alternate_in_every_pair():
    assert fleet_build.order(0) == ("shared", "each")
    assert fleet_build.order(1) == ("each", "shared")
    assert fleet_build.plan(1) == [(0, "shared"), (0, "each")]
    assert fleet_build.plan(3) == [
        (0, "shared"), (0, "each"), (1, "each"), (1, "shared"), (2, "shared"), (2, "each")
    ]  # fmt: skip


def test_durations_as_llamarig_prints_them():
    assert fleet_build.duration_s("7s") == 7
    assert fleet_build.duration_s("3m05s") == 185
    assert fleet_build.duration_s("1h02m05s") == 3725
    with pytest.raises(ValueError):
        fleet_build.duration_s("3 minutes")


KEY = "0c1e57098bba-1a2b3c4d5e-0123456789ab"
SHARED_OUTPUT = f"""\
--> Starting operation: tasks/llama_cpp.py | Build llama-server (0c1e57098bba-1a2b3c4d5e)
    \x1b[1m[sandbox-fbb-1]\x1b[0m build: [120/212] 2m10s elapsed
    \x1b[1m[sandbox-fbb-1]\x1b[0m build: built in 3m12s (212 steps)
    [sandbox-fbb-1] llamarig: build {KEY} kept in /tmp/c/{KEY} (5 files, 12.3 MiB, 4.2 s) for \
the other rigs of its key
    [sandbox-fbb-2] llamarig: build {KEY} shipped from sandbox-fbb-1 (5 files checked, 1.5 s); \
no compiler runs here
"""
EACH_OUTPUT = """\
    [sandbox-fbb-1] build: built in 6m01s (212 steps)
    [sandbox-fbb-2] build: built in 6m09s (212 steps)
"""


def test_what_a_deploys_output_says_of_its_builds():
    facts = fleet_build.deploy_facts(SHARED_OUTPUT)
    assert facts["built_s"] == {"sandbox-fbb-1": 192}
    assert facts["kept"] == [
        {"host": "sandbox-fbb-1", "key": KEY, "files": 5, "mib": 12.3, "seconds": 4.2}
    ]
    assert facts["shipped"] == [
        {"host": "sandbox-fbb-2", "key": KEY, "source": "sandbox-fbb-1", "files": 5,
         "seconds": 1.5}
    ]  # fmt: skip
    assert fleet_build.arm_problem("shared", facts) is None
    each = fleet_build.deploy_facts(EACH_OUTPUT)
    assert each == {"built_s": {"sandbox-fbb-1": 361, "sandbox-fbb-2": 369}, "kept": [],
                    "shipped": []}  # fmt: skip
    assert fleet_build.arm_problem("each", each) is None


def test_an_arm_that_did_not_do_what_it_says_is_named():
    shared, each = (fleet_build.deploy_facts(text) for text in (SHARED_OUTPUT, EACH_OUTPUT))
    assert "expected only sandbox-fbb-1 to build" in fleet_build.arm_problem("shared", each)
    assert "expected both rigs to build" in fleet_build.arm_problem("each", shared)
    both_built = dict(shared, built_s=each["built_s"], kept=[], shipped=[])
    assert "nothing kept or shipped" not in (fleet_build.arm_problem("each", both_built) or "")
    shipped_too = dict(each, shipped=shared["shipped"])
    assert "nothing kept or shipped" in fleet_build.arm_problem("each", shipped_too)
    not_shipped = dict(shared, shipped=[])
    assert "to get sandbox-fbb-1's build" in fleet_build.arm_problem("shared", not_shipped)


def record(pair, arm, wall, compile_cpu=None, sandbox_cpu=None, built=None):
    return {"pair": pair, "arm": arm, "wall_s": wall, "compile_cpu_s": compile_cpu,
            "sandbox_cpu_s": sandbox_cpu, "built_s": built or {}}  # fmt: skip


def test_the_medians_and_the_ratio_of_the_arms():
    records = [
        record(0, "shared", 300.0, {"sandbox-fbb-1": 380.0, "sandbox-fbb-2": 0.0},
               {"sandbox-fbb-1": 420.0, "sandbox-fbb-2": 30.0}, {"sandbox-fbb-1": 190}),
        record(0, "each", 500.0, {"sandbox-fbb-1": 390.0, "sandbox-fbb-2": 392.0},
               {"sandbox-fbb-1": 430.0, "sandbox-fbb-2": 431.0},
               {"sandbox-fbb-1": 400, "sandbox-fbb-2": 410}),
        record(1, "each", 520.0),
        record(1, "shared", 280.0),
        record(2, "shared", 320.0),
        record(2, "each", 480.0),
    ]  # fmt: skip
    summary = fleet_build.summarize(records)
    shared, each = summary["arms"]["shared"], summary["arms"]["each"]
    assert shared["wall_s"] == [300.0, 280.0, 320.0] and shared["wall_median_s"] == 300.0
    assert each["wall_median_s"] == 500.0 and each["runs"] == 3
    assert summary["ratio"] == 0.6
    assert summary["pair_ratios"] == [0.6, round(280 / 520, 3), round(320 / 480, 3)]
    assert shared["compile_cpu_median_s"] == 380.0 and each["compile_cpu_median_s"] == 782.0
    assert shared["sandbox_cpu_median_s"] == 450.0 and each["sandbox_cpu_median_s"] == 861.0
    assert shared["longest_build_median_s"] == 190 and each["longest_build_median_s"] == 410


def test_an_arm_without_runs_has_no_median_and_no_ratio():
    summary = fleet_build.summarize([record(0, "shared", 300.0)])
    assert summary["arms"]["each"]["wall_median_s"] is None
    assert summary["ratio"] is None and summary["pair_ratios"] == []
    assert "shared / each -" in fleet_build.summary_line(summary)


def results():
    records = [
        dict(
            record(0, "shared", 301.24, {"sandbox-fbb-1": 380.0, "sandbox-fbb-2": 0.0},
                   {"sandbox-fbb-1": 420.0, "sandbox-fbb-2": 30.0}, {"sandbox-fbb-1": 190}),
            kept=[{"host": "sandbox-fbb-1", "key": KEY, "files": 5, "mib": 12.3,
                   "seconds": 4.2}],
            shipped=[{"host": "sandbox-fbb-2", "key": KEY, "source": "sandbox-fbb-1",
                      "files": 5, "seconds": 1.5}],
            machine_busy_cpu_s=470.0, machine_capacity_cpu_s=602.0, others_sandbox_tests=[],
        ),
        dict(
            record(0, "each", 502.0, {"sandbox-fbb-1": 390.0, "sandbox-fbb-2": 392.0},
                   {"sandbox-fbb-1": 430.0, "sandbox-fbb-2": 431.0},
                   {"sandbox-fbb-1": 400, "sandbox-fbb-2": 410}),
            kept=[], shipped=[], machine_busy_cpu_s=900.0, machine_capacity_cpu_s=1004.0,
            others_sandbox_tests=[],
        ),
    ]  # fmt: skip
    meta = {"started": "2026-12-08T10:00:00+00:00", "finished": "2026-12-08T10:15:00+00:00",
            "commit": "abcdef012345", "nproc": 2, "cpu_model": "Intel Xeon",
            "machine": "24 GiB, Linux 6.1", "llama_cpp": "0c1e57098bba", "rounds": 1}  # fmt: skip
    return {"meta": meta, "summary": fleet_build.summarize(records), "runs": records}


def test_the_table_and_the_section():
    text = fleet_build.markdown(results())
    lines = fleet_build.markdown_table(results()["summary"]).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 8
    assert lines[2] == (
        "| one build, shipped (share_builds: true) | 1 | 301.2 | 301.2 | 190.0 | 380.0 | 450.0 |"
    )
    assert lines[3].startswith("| each rig compiles (share_builds: false) | 1 | 502.0 | 502.0 |")
    assert "2 x Intel Xeon" in text and "llama.cpp `0c1e57098bba`" in text
    assert "2026-12-08T10:00:00+00:00" in text
    assert "shared / each 0.600, 40% less wall time; per pair: 0.600." in text
    assert "kept by sandbox-fbb-1 (12.3 MiB, 4.2 s), shipped to sandbox-fbb-2 (1.5 s)" in text
    assert "built: sandbox-fbb-1 400 s, sandbox-fbb-2 410 s" in text
    assert "compile CPU-s: 390 + 392" in text


def test_the_section_replaces_its_markers_or_is_appended():
    section = "## New\n\ntext\n"
    begin, end = fleet_build.SECTION_BEGIN, fleet_build.SECTION_END
    document = f"# Results\n\nbefore\n\n{begin}\nold\n{end}\n\nafter\n"
    replaced = fleet_build.replace_section(document, section)
    assert replaced == f"# Results\n\nbefore\n\n{begin}\n## New\n\ntext\n{end}\n\nafter\n"
    assert fleet_build.replace_section(replaced, section) == replaced
    appended = fleet_build.replace_section("# Results\n\nbefore\n", section)
    assert appended == f"# Results\n\nbefore\n\n{begin}\n## New\n\ntext\n{end}\n"
    # Another bench's markers are left alone.
    other = "<!-- bench/converge.py: begin -->\nx\n<!-- bench/converge.py: end -->\n"
    assert fleet_build.replace_section(other, section).startswith(other)


def test_the_build_lock_commands_are_recognised():
    lock = "/opt/llamarig/builds/0c1e57098bba-1a2b/.llamarig-build.lock"
    assert fleet_build.is_build_lock(["flock", lock, "cmake", "-S", "x", "-B", "y"])
    assert fleet_build.is_build_lock(["/usr/bin/flock", lock, "/usr/bin/cmake", "--build", "y"])
    assert not fleet_build.is_build_lock(["flock", "/tmp/other.lock", "cmake", "--build", "y"])
    assert not fleet_build.is_build_lock(["sh", "-c", f"flock {lock} cmake"])
    assert not fleet_build.is_build_lock([])


def test_cpu_time_of_a_process_tree_counts_reaped_children_once():
    table = {1: (0, 5.0), 10: (1, 2.0), 11: (10, 3.0), 12: (11, 1.0), 20: (1, 4.0)}
    assert fleet_build.descendants(table, 10) == {11, 12}
    assert fleet_build.descendants(table, 1) == {10, 11, 12, 20}
    assert fleet_build.tree_cpu_s(table, {10, 11, 12}) == 6.0
    assert fleet_build.tree_cpu_s(table, {99}) == 0


def test_this_machines_process_table_sees_a_busy_child():
    busy = "import time\nend = time.time() + 0.4\nwhile time.time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        time.sleep(0.3)
        table = fleet_build.process_table()
        assert table[child.pid][0] == os.getpid()
        assert child.pid in fleet_build.descendants(table, os.getpid())
        assert table[child.pid][1] > 0
    finally:
        child.wait()
    # Once reaped, its time is this process's children's time.
    assert fleet_build.process_table()[os.getpid()][1] >= os.times().children_user


def test_rounds_out_of_bounds_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        fleet_build.main(["--rounds", "0"])
    assert exit_info.value.code == 2
    assert "--rounds: 1..20" in capsys.readouterr().err
