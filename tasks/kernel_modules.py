"""Kernel modules: keep nouveau and nova off the GPUs, load nvidia and nvidia_uvm at boot,
rebuild the initramfs when the blacklist changed, and reboot by the rig's policy."""

from io import StringIO

from pyinfra import host
from pyinfra.operations import server
from pyinfra.operations.util import any_changed

from llamarig import operations, render, stage

rig = stage.rig()

if rig["driver"]["source"] == "none":
    host.noop("no NVIDIA driver wanted: kernel modules left as they are")
elif not rig["kernel_modules"]["manage"]:
    host.noop("kernel_modules.manage is false: modules, initramfs and reboots left to the host")
else:
    blacklist = operations.atomic_file(
        name="Blacklist nouveau, nova_core and nova",
        src=StringIO(render.render_file("modprobe-blacklist.conf.j2")),
        dest="/etc/modprobe.d/llamarig-blacklist-nouveau-nova.conf",
        mode="644",
    )
    operations.atomic_file(
        name="Load nvidia and nvidia_uvm at boot (the service needs /dev/nvidia-uvm)",
        src=StringIO("# Managed by llamarig\nnvidia\nnvidia_uvm\n"),
        dest="/etc/modules-load.d/llamarig-nvidia.conf",
        mode="644",
    )
    server.shell(
        name="Rebuild the initramfs (the blacklist changed)",
        commands=[
            "if command -v update-initramfs >/dev/null; then update-initramfs -u -k all; "
            "elif command -v dracut >/dev/null; then dracut -f --regenerate-all; "
            "else echo 'no initramfs tool on this host: nothing to rebuild'; fi"
        ],
        _if=blacklist.did_change,
    )
    stage.record("reboot", blacklist)

    policy = rig["reboot"]
    needs_reboot = stage.recorded("reboot")
    if stage.is_local():
        if any(operation.will_change for operation in needs_reboot) or policy == "always":
            host.noop("a reboot is needed to load the new modules; @local is never rebooted")
    elif policy == "never":
        if any(operation.will_change for operation in needs_reboot):
            host.noop("reboot policy `never`: reboot this host to load the new modules")
    elif policy == "always":
        operations.reboot(name="Reboot (policy `always`)")
    else:
        operations.reboot(
            name="Reboot to load the new modules (policy `if-needed`)",
            _if=any_changed(*needs_reboot),
        )
