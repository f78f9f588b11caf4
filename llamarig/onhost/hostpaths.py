"""Every path and marker llamarig owns on a host, in one place. The paths that depend on the
rig data (prefix, models, service names) are `render.layout`'s, built from these."""

from __future__ import annotations

STATE_DIRECTORY = "/var/lib/llamarig"
CONFIG_DIRECTORY = "/etc/llamarig"
SYSTEMD_UNIT_DIRECTORY = "/etc/systemd/system"

# The API key on the host (root only), and a curl header file made from it for the deploy's own
# checks (curl -H @FILE keeps the key out of every command line). Only requests to the rig's own
# llama-server (`render.base_url`, asked on the host) send it: the deploy's and verify's checks,
# status, complete and tune; never a model URL or another host.
API_KEY_PATH = f"{CONFIG_DIRECTORY}/api-key"
API_KEY_HEADER_PATH = f"{CONFIG_DIRECTORY}/api-key.header"
# curl's header option where the host has an API key, nothing where it has none.
CURL_AUTH = f'$([ -f {API_KEY_HEADER_PATH} ] && echo "-H @{API_KEY_HEADER_PATH}")'
# The Hugging Face token's only copy on a host: root's alone, in a directory only root may
# enter, read by curl as a header file (the model download; the plan's header read) only for a
# URL of the Hub endpoint (`reference.sends_hub_token`), and removed by the first converge whose
# models need it no more (tasks/model.py).
HUB_TOKEN_DIRECTORY = f"{CONFIG_DIRECTORY}/hub"
HUB_TOKEN_HEADER_PATH = f"{HUB_TOKEN_DIRECTORY}/authorization-header"

# What nvidia-smi showed per GPU beyond the plan's buffers after a start, one file per build and
# split mode (`BUILD.MODE`: the MiB of each used GPU, in the plan's device order).
OVERHEADS_DIR = f"{STATE_DIRECTORY}/gpu-overheads"
# Copies of the unit, env file and `current` target of the last version that served, one
# directory per service.
LAST_GOOD_DIRECTORY = f"{STATE_DIRECTORY}/last-good"
# The sha256 records of checked files, one per path (checksums.py).
CHECKSUM_RECORDS = f"{STATE_DIRECTORY}/checksums"
# The last run's record (deploy_record.py), and the mark a rollback leaves for it.
DEPLOY_RECORD_PATH = f"{STATE_DIRECTORY}/last-deploy.json"
ROLLED_BACK_PATH = f"{STATE_DIRECTORY}/rolled-back"

# The driver packages' installation log, and the DKMS build of theirs that failed, for which
# version and kernel (driver_build.py).
DRIVER_INSTALL_LOG = "/var/log/llamarig-driver-install.log"
DRIVER_BUILD_FAILURE_PATH = f"{STATE_DIRECTORY}/driver-build-failed"

# A build directory holds this file once its build completed.
BUILD_COMPLETE_MARKER = ".llamarig-build.json"
# Where a detached job keeps its pid, log and exit status: beside the file it makes, or in
# the build directory.
JOB_DIRECTORY = ".llamarig-job"
# The complete copy sits beside its file (a rename is atomic only within one filesystem) under
# a suffix that systemd, modprobe, apt and the shell ignore.
ATOMIC_SUFFIX = ".llamarig-new"
# apt's own stamp of its last successful update (not llamarig's, read to tell stale lists).
APT_UPDATE_STAMP = "/var/lib/apt/periodic/update-success-stamp"
# Debian's and Ubuntu's dkms default key pair (dkms 3.x `mok_signing_key`/`mok_certificate`).
MOK_KEY = "/var/lib/dkms/mok.key"
MOK_CERTIFICATE = "/var/lib/dkms/mok.pub"

# The gateway (HAProxy from the distribution): its configuration, read by Debian's unit, and
# what it reads beside it. HAProxy's master reads them as root before its workers drop to the
# haproxy user, so the secrets among them (the rigs' key, the TLS key) stay root's alone.
HAPROXY_CONFIG = "/etc/haproxy/haproxy.cfg"
GATEWAY_DIRECTORY = "/etc/haproxy/llamarig"
GATEWAY_USERS_MAP = f"{GATEWAY_DIRECTORY}/users.map"
GATEWAY_RIG_KEY_MAP = f"{GATEWAY_DIRECTORY}/rig-key.map"
GATEWAY_MODELS_JSON = f"{GATEWAY_DIRECTORY}/models.json"
GATEWAY_TLS_PEM = f"{GATEWAY_DIRECTORY}/tls.pem"
# The certificate alone (no key), for `llamarig status` and the copy clients trust.
GATEWAY_TLS_CERT = f"{GATEWAY_DIRECTORY}/tls.crt"
# The runtime API (root only; never on the network), and the servers' state a reload keeps.
GATEWAY_ADMIN_SOCKET = "/run/haproxy/admin.sock"
GATEWAY_SERVER_STATE = "/var/lib/haproxy/server-state"
