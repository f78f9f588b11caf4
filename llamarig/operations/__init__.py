"""Custom pyinfra operations, one module per domain (as pyinfra's own). Each reads facts and
yields only the commands needed, so a second run with nothing to do yields nothing (and pyinfra
counts it as unchanged)."""

from llamarig.operations.apt import apt_lists_fresh, apt_packages, driver_packages
from llamarig.operations.build import (
    BuildReport,
    cmake_build,
    git_checkout_commands,
    git_commit,
    prune_builds,
)
from llamarig.operations.download import (
    DownloadReport,
    check_file,
    fetch_checked,
    fetch_command,
    record_checksum,
    record_headers,
)
from llamarig.operations.drain import (
    DRAIN_POLL_S,
    DRAIN_REPORT_S,
    Drain,
    drain,
)
from llamarig.operations.files import (
    absent,
    atomic_file,
    curl_auth_header,
    directory,
    rename_into_place,
    secret_file,
    symlink,
)
from llamarig.operations.host import (
    barrier,
    connected_host,
    fail,
    machine_owner_key,
    reboot,
)
from llamarig.operations.rollback import serve_or_roll_back
from llamarig.operations.serve import (
    check_rpc_workers,
    check_server_flags,
    check_serving,
    record_gpu_overheads,
    reload_presets,
    restart_rpc_head,
    server_flags,
    tcp_probe,
    wait_for_port,
    wrong_answers,
)
from llamarig.operations.shipping import install_shipped_build, pack_build
from llamarig.operations.systemd import (
    check_unit_active,
    journal_tail_command,
    reset_failed_command,
    restart_command,
    restart_service,
    unit_running,
)

__all__ = [
    "BuildReport",
    "DRAIN_POLL_S",
    "DRAIN_REPORT_S",
    "DownloadReport",
    "Drain",
    "absent",
    "apt_lists_fresh",
    "apt_packages",
    "install_shipped_build",
    "pack_build",
    "atomic_file",
    "barrier",
    "check_file",
    "check_rpc_workers",
    "check_server_flags",
    "check_serving",
    "check_unit_active",
    "cmake_build",
    "connected_host",
    "curl_auth_header",
    "directory",
    "drain",
    "driver_packages",
    "fail",
    "fetch_checked",
    "fetch_command",
    "git_checkout_commands",
    "git_commit",
    "journal_tail_command",
    "machine_owner_key",
    "prune_builds",
    "reboot",
    "record_checksum",
    "record_gpu_overheads",
    "reload_presets",
    "record_headers",
    "rename_into_place",
    "reset_failed_command",
    "restart_command",
    "restart_rpc_head",
    "restart_service",
    "secret_file",
    "serve_or_roll_back",
    "server_flags",
    "symlink",
    "tcp_probe",
    "unit_running",
    "wait_for_port",
    "wrong_answers",
]
