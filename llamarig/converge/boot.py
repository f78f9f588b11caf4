"""What the kernel_modules stage writes and when it reboots (pure: the stage turns the answer
into operations)."""

from __future__ import annotations

from dataclasses import dataclass

BLACKLIST_PATH = "/etc/modprobe.d/llamarig-blacklist-nouveau-nova.conf"
MODULES_LOAD_PATH = "/etc/modules-load.d/llamarig-nvidia.conf"
# nvidia_uvm too: the service needs /dev/nvidia-uvm, which only that module creates.
LOADED_AT_BOOT = ("nvidia", "nvidia_uvm")

# Only the blacklist is in the initramfs; the tool differs between Debian/Ubuntu and the rest.
REBUILD_INITRAMFS = (
    "if command -v update-initramfs >/dev/null; then update-initramfs -u -k all; "
    "elif command -v dracut >/dev/null; then dracut -f --regenerate-all; "
    "else echo 'no initramfs tool on this host: nothing to rebuild'; fi"
)


@dataclass(frozen=True)
class RebootStep:
    """One of: a note for the operator (``note``), a reboot (``reboot``, the operation's name)
    that runs always or only when an input of the modules changed (``only_if_changed``), or
    nothing (both None)."""

    note: str | None = None
    reboot: str | None = None
    only_if_changed: bool = False


def reboot_step(policy: str, local: bool, may_change: bool) -> RebootStep:
    """The step for reboot ``policy`` (``always``, ``never``, ``if-needed``) on a host that is
    pyinfra's @local (``local``, never rebooted) or not, when the driver or blacklist may change
    in this run (``may_change``, known before anything runs)."""
    if local:
        if may_change or policy == "always":
            return RebootStep(
                note="a reboot is needed to load the new modules; @local is never rebooted"
            )
        return RebootStep()
    if policy == "never":
        if may_change:
            return RebootStep(
                note="reboot policy `never`: reboot this host to load the new modules"
            )
        return RebootStep()
    if policy == "always":
        return RebootStep(reboot="Reboot (policy `always`)")
    return RebootStep(
        reboot="Reboot to load the new modules (policy `if-needed`)", only_if_changed=True
    )
