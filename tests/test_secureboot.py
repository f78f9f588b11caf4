"""driver.secure_boot: the pure decisions (llamarig/converge/secureboot.py), Ubuntu's signed
prebuilt package names, the facts' parsers, and the driver stage's reading of the facts (a host
whose facts are given; no Ubuntu archive is reachable here)."""

from __future__ import annotations

import pytest

from llamarig.converge import secureboot
from llamarig.converge.secureboot import Decision, decide, loaded_module_problems
from llamarig.facts.apt import AptCandidates
from llamarig.facts.driver import DkmsSigning, FirmwareBoot, MokKeyState, NvidiaModule
from llamarig.tables.packages import prebuilt_module_packages
from tasks import driver as driver_stage

UBUNTU_KERNEL = "6.8.0-50-generic"
PREBUILT_580_OPEN = [
    "linux-modules-nvidia-580-open-6.8.0-50-generic",
    "linux-modules-nvidia-580-open-generic",
    "nvidia-utils-580",
    "libnvidia-compute-580",
]
NOT_ENROLLED = secureboot.DkmsSigning(enrollment="not-enrolled")
ENROLLED = secureboot.DkmsSigning(key_exists=True, certificate_exists=True, enrollment="enrolled")


def decision(mode="auto", secure_boot=True, source="distro", debian=False, **changes):
    arguments = {
        "kernel": UBUNTU_KERNEL,
        "branch": 580,
        "open_modules": True,
        "signing": NOT_ENROLLED,
        "apt_candidates": dict.fromkeys(PREBUILT_580_OPEN, "6.8.0-50.51"),
        **changes,
    }
    return decide(mode, secure_boot, source, debian=debian, **arguments)


class TestSecureBootOffOrNoDkms:
    @pytest.mark.parametrize("mode", secureboot.MODES)
    @pytest.mark.parametrize("secure_boot", [False, None])
    @pytest.mark.parametrize("source", ["nvidia-repo", "distro"])
    def test_nothing_changes(self, mode, secure_boot, source):
        assert decision(mode, secure_boot, source) == Decision("unchanged")

    @pytest.mark.parametrize("mode", secureboot.MODES)
    @pytest.mark.parametrize("source", ["preinstalled", "none"])
    def test_a_driver_llamarig_does_not_build_is_left_alone(self, mode, source):
        assert decision(mode, True, source) == Decision("unchanged")


class TestAuto:
    def test_ubuntu_takes_canonicals_signed_modules_for_the_running_kernel(self):
        chosen = decision()
        assert chosen.action == "prebuilt"
        assert chosen.packages.packages == PREBUILT_580_OPEN
        assert chosen.packages.dkms_package is None  # nothing is built, nothing to sign

    def test_ubuntu_without_the_running_kernels_package_stops_with_the_steps(self):
        candidates = dict.fromkeys(PREBUILT_580_OPEN, "6.8.0-50.51")
        candidates["linux-modules-nvidia-580-open-6.8.0-50-generic"] = None
        chosen = decision(apt_candidates=candidates)
        assert chosen.action == "stop"
        text = "\n".join(chosen.steps)
        assert "nothing was installed" in chosen.steps[0]
        assert "linux-modules-nvidia-580-open-6.8.0-50-generic" in text
        assert "apt update" in text
        assert "driver.secure_boot: sign" in text
        assert "mokutil --import /var/lib/dkms/mok.pub" in text

    def test_debian_has_no_signed_modules_and_stops(self):
        chosen = decision(debian=True, kernel="6.1.0-28-amd64", apt_candidates={})
        assert chosen.action == "stop"
        text = "\n".join(chosen.steps)
        assert "linux-modules-nvidia" not in text
        assert "openssl req -new -x509" in text and "turn Secure Boot off" in text

    def test_nvidia_repo_on_ubuntu_stops_and_names_the_signed_modules(self):
        chosen = decision(source="nvidia-repo")
        assert chosen.action == "stop"
        assert any("linux-modules-nvidia-580-open-6.8.0-50-generic" in s for s in chosen.steps)

    def test_dkms_already_signing_with_an_enrolled_key_proceeds(self):
        assert decision(debian=True, signing=ENROLLED) == Decision("unchanged")

    def test_a_key_that_exists_but_is_not_enrolled_still_stops(self):
        pending = secureboot.DkmsSigning(
            key_exists=True, certificate_exists=True, enrollment="pending"
        )
        assert decision(debian=True, signing=pending).action == "stop"


class TestSignAndRefuse:
    @pytest.mark.parametrize(
        ("enrollment", "queued"),
        [("not-enrolled", True), ("unknown", True), ("pending", False), ("enrolled", False)],
    )
    def test_sign_queues_the_enrollment_only_once(self, enrollment, queued):
        signing = secureboot.DkmsSigning(enrollment=enrollment)
        chosen = decision("sign", debian=True, signing=signing)
        assert chosen.action == "sign"
        assert chosen.queue_enrollment is queued

    def test_sign_on_ubuntu_signs_rather_than_take_the_prebuilt_modules(self):
        assert decision("sign").action == "sign"

    def test_refuse_stops_even_where_signed_modules_exist(self):
        chosen = decision("refuse")
        assert chosen.action == "stop"
        assert "`refuse`" in chosen.steps[0]


class TestPrebuiltPackageNames:
    def test_proprietary_modules_have_no_open_suffix(self):
        names = prebuilt_module_packages(570, "6.8.0-1015-aws", open_modules=False).packages
        assert names[:2] == [
            "linux-modules-nvidia-570-6.8.0-1015-aws",
            "linux-modules-nvidia-570-aws",
        ]

    def test_a_multi_part_flavour_is_kept_whole(self):
        names = prebuilt_module_packages(580, "6.8.0-50-generic-64k", open_modules=True).packages
        assert names[1] == "linux-modules-nvidia-580-open-generic-64k"

    @pytest.mark.parametrize("kernel", ["6.12.0", "6.8.0-50-generic; reboot", ""])
    def test_a_kernel_without_an_ubuntu_flavour_names_nothing(self, kernel):
        assert prebuilt_module_packages(580, kernel, open_modules=True).packages == []


class TestLoadedModule:
    SIGNED = {"present": True, "signer": secureboot.MOK_COMMON_NAME, "loaded": True}

    def test_a_signed_loaded_module_with_an_enrolled_key_passes(self):
        assert loaded_module_problems("sign", True, self.SIGNED, ENROLLED) == []

    def test_an_unconfirmed_enrollment_says_to_confirm_it_at_the_console(self):
        pending = secureboot.DkmsSigning(enrollment="pending")
        module = {**self.SIGNED, "loaded": False}
        (problem,) = loaded_module_problems("sign", True, module, pending)
        assert "confirm the enrollment at the console" in problem

    def test_an_unsigned_module_names_the_rebuild(self):
        module = {"present": True, "signer": "", "loaded": False}
        problems = loaded_module_problems("sign", True, module, ENROLLED)
        assert any("dkms autoinstall --force" in problem for problem in problems)
        assert any("does not load" in problem for problem in problems)

    def test_a_cancelled_enrollment_says_to_queue_it_again(self):
        module = {**self.SIGNED, "loaded": False}
        (problem,) = loaded_module_problems("sign", True, module, NOT_ENROLLED)
        assert "is not enrolled" in problem

    @pytest.mark.parametrize(("mode", "secure_boot"), [("auto", True), ("sign", False)])
    def test_only_sign_with_secure_boot_on_is_checked(self, mode, secure_boot):
        module = {"present": True, "signer": "", "loaded": False}
        assert loaded_module_problems(mode, secure_boot, module, NOT_ENROLLED) == []

    def test_no_module_yet_is_not_a_problem(self):
        module = {"present": False, "signer": "", "loaded": False}
        assert loaded_module_problems("sign", True, module, NOT_ENROLLED) == []


class TestFacts:
    @pytest.mark.parametrize(
        ("line", "state"),
        [
            ("SecureBoot enabled", True),
            ("SecureBoot disabled", False),
            ("   0", False),
            ("unknown", None),
        ],
    )
    def test_firmware_reads_mokutil_where_the_variable_is_unreadable(self, line, state):
        assert FirmwareBoot().process(["uefi", line])["secure_boot"] is state

    def test_firmware_command_asks_mokutil_only_without_the_variable(self):
        command = FirmwareBoot().command()
        assert command.index(FirmwareBoot.EFIVAR) < command.index("mokutil --sb-state")

    def test_dkms_signing_defaults_to_the_dkms_pair(self):
        assert DkmsSigning().process([]) == {
            "key": "/var/lib/dkms/mok.key",
            "certificate": "/var/lib/dkms/mok.pub",
        }

    def test_dkms_signing_takes_the_last_assignment_unquoted(self):
        output = [
            'mok_signing_key="/var/lib/shim-signed/mok/MOK.priv"',
            "mok_certificate=/var/lib/shim-signed/mok/MOK.der  # Ubuntu's",
            "  mok_signing_key='/root/mok.key'",
        ]
        assert DkmsSigning().process(output) == {
            "key": "/root/mok.key",
            "certificate": "/var/lib/shim-signed/mok/MOK.der",
        }

    @pytest.mark.parametrize(
        ("answer", "enrollment"),
        [
            ("/var/lib/dkms/mok.pub is already enrolled", "enrolled"),
            ("/var/lib/dkms/mok.pub is already in the enrollment request", "pending"),
            ("/var/lib/dkms/mok.pub is not enrolled", "not-enrolled"),
            ("EFI variables are not supported on this system", "unknown"),
        ],
    )
    def test_mok_key_state_reads_mokutils_answer(self, answer, enrollment):
        state = MokKeyState().process(["key 600", "certificate yes", f"test {answer}"])
        assert state == {
            "key_exists": True,
            "key_mode": "600",
            "certificate_exists": True,
            "enrollment": enrollment,
        }

    def test_mok_key_state_of_a_host_without_keys(self):
        state = MokKeyState().process(["key -", "certificate -"])
        assert state["key_exists"] is False and state["enrollment"] == "unknown"

    def test_mok_key_state_quotes_its_paths(self):
        command = MokKeyState().command(key="/k; reboot", certificate="/c")
        assert "'/k; reboot'" in command

    def test_nvidia_module_asks_for_debians_names_too(self):
        command = NvidiaModule().command()
        assert "for m in nvidia nvidia-current nvidia-current-open;" in command
        assert "/sys/module/nvidia_current_open" in command

    def test_nvidia_module(self):
        output = ["present", f"signer={secureboot.MOK_COMMON_NAME}", "loaded"]
        assert NvidiaModule().process(output) == {
            "present": True,
            "signer": secureboot.MOK_COMMON_NAME,
            "loaded": True,
        }
        assert NvidiaModule().process([]) == {"present": False, "signer": "", "loaded": False}

    @pytest.mark.parametrize("fact", [DkmsSigning, MokKeyState, NvidiaModule, AptCandidates])
    def test_a_fact_without_output_is_its_empty_reading(self, fact):
        # pyinfra returns default() when the command prints nothing (no dkms config, no module).
        assert fact().default() == fact().process([])
        assert fact().default() is not None

    def test_apt_candidates(self):
        output = ["linux-modules-nvidia-580-open-generic 6.8.0-50.51", "", "nvidia-utils-580 "]
        output.append("libnvidia-compute-580 (none)")
        assert AptCandidates().process(output) == {
            "linux-modules-nvidia-580-open-generic": "6.8.0-50.51",
            "nvidia-utils-580": None,
            "libnvidia-compute-580": None,
        }


class TestOneTimePassword:
    def test_typeable_and_fresh(self):
        first, second = secureboot.one_time_password(), secureboot.one_time_password()
        assert first != second
        assert len(first) == 12 and first.isalnum() and first == first.lower()
        assert not set(first) & set("01ilo")  # no look-alikes at the console

    def test_the_notice_names_the_console_step_and_the_password_once(self):
        notice = secureboot.enrollment_notice("abc123", secureboot.MOK_CERTIFICATE)
        assert notice.count("abc123") == 1
        assert "Enroll MOK" in notice and "next boot" in notice


class FakeHost:
    """A host whose facts are given; a fact not given fails the test (it was not to be read)."""

    def __init__(self, facts: dict):
        self.facts = facts
        self.asked: list[str] = []

    def get_fact(self, fact, **arguments):
        self.asked.append(fact.__name__)
        if fact.__name__ not in self.facts:
            raise AssertionError(f"{fact.__name__} read, but it should not be")
        value = self.facts[fact.__name__]
        return value(**arguments) if callable(value) else value


def rig(source="distro", mode="auto"):
    return {"driver": {"source": source, "branch": 580, "open": True, "secure_boot": mode}}


UBUNTU_2404 = {"name": "Ubuntu", "release_meta": {"ID": "ubuntu", "VERSION_ID": "24.04"}}
DEBIAN_12 = {"name": "Debian", "release_meta": {"ID": "debian", "VERSION_ID": "12"}}


class TestDriverStageReadsTheFacts:
    def host(self, monkeypatch, secure_boot, distribution=UBUNTU_2404, candidates=None):
        def apt_candidates(packages):
            return {name: (candidates or {}).get(name) for name in packages}

        fake = FakeHost(
            {
                "FirmwareBoot": {"uefi": True, "secure_boot": secure_boot},
                "LinuxDistribution": distribution,
                "KernelVersion": UBUNTU_KERNEL,
                "AptCandidates": apt_candidates,
                "DkmsSigning": {
                    "key": secureboot.MOK_KEY,
                    "certificate": secureboot.MOK_CERTIFICATE,
                },
                "MokKeyState": lambda key, certificate: {
                    "key_exists": False,
                    "key_mode": None,
                    "certificate_exists": False,
                    "enrollment": "unknown",
                },
            }
        )
        monkeypatch.setattr(driver_stage, "host", fake)
        # The stage reads facts through factcache.known, pyinfra's host.get_fact kept per run.
        monkeypatch.setattr(driver_stage, "known", fake.get_fact)
        return fake

    def test_secure_boot_off_reads_nothing_more_and_changes_nothing(self, monkeypatch):
        fake = self.host(monkeypatch, secure_boot=False)
        assert driver_stage.secure_boot_decision(rig()) == Decision("unchanged")
        assert fake.asked == ["FirmwareBoot"]

    def test_ubuntu_plan_installs_the_signed_modules_apt_offers(self, monkeypatch):
        self.host(monkeypatch, True, candidates=dict.fromkeys(PREBUILT_580_OPEN, "1"))
        chosen = driver_stage.secure_boot_decision(rig())
        assert chosen.action == "prebuilt"
        assert chosen.packages.packages == PREBUILT_580_OPEN

    def test_ubuntu_plan_without_them_stops(self, monkeypatch):
        self.host(monkeypatch, True, candidates={})
        chosen = driver_stage.secure_boot_decision(rig())
        assert chosen.action == "stop"

    def test_debian_does_not_ask_apt_for_ubuntus_packages(self, monkeypatch):
        fake = self.host(monkeypatch, True, distribution=DEBIAN_12)
        assert driver_stage.secure_boot_decision(rig(mode="sign")).action == "sign"
        assert "AptCandidates" not in fake.asked

    def test_apt_is_asked_for_each_package_quoted(self):
        command = AptCandidates().command(packages=PREBUILT_580_OPEN)
        for name in PREBUILT_580_OPEN:
            assert f"apt-cache policy {name} " in command


class TestVerifyTrust:
    LOADED = {"present": True, "signer": secureboot.MOK_COMMON_NAME, "loaded": True}
    LISTING = (
        "[key 1]\nSHA1 Fingerprint: 00:11\n        X509v3 Subject Key Identifier: \n"
        "            3A:4F:9C:10:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89\n"
    )

    def test_a_module_signed_by_an_enrolled_key_is_trusted(self):
        key = "3A:4F:9C:10:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89"
        assert secureboot.untrusted_module_problem(self.LOADED, key, self.LISTING) is None

    def test_canonicals_signature_is_trusted(self):
        module = {**self.LOADED, "signer": "Canonical Ltd. Kernel Module Signing"}
        assert secureboot.untrusted_module_problem(module, "AA:BB", "") is None

    def test_a_key_not_enrolled_is_named(self):
        problem = secureboot.untrusted_module_problem(self.LOADED, "DE:AD:BE:EF", self.LISTING)
        assert "not among the enrolled" in problem and "DE:AD:BE:EF" in problem

    def test_a_module_that_did_not_load_points_at_the_rejected_key(self):
        module = {**self.LOADED, "loaded": False}
        assert "Key was rejected" in secureboot.untrusted_module_problem(module, "", "")

    def test_an_unsigned_module_fails(self):
        module = {**self.LOADED, "signer": ""}
        assert "no signature" in secureboot.untrusted_module_problem(module, "", self.LISTING)
