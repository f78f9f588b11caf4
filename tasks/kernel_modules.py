"""Kernel modules: keep nouveau and nova off the GPUs, load nvidia and nvidia_uvm at boot,
rebuild the initramfs when the blacklist changed, and reboot by the rig's policy."""

from io import StringIO

from pyinfra import api, host
from pyinfra.api.operation import OperationMeta
from pyinfra.operations import server
from pyinfra.operations.util import any_changed

from llamarig import operations
from llamarig.converge import boot, stage
from llamarig.planner import render


@api.deploy("tasks/kernel_modules.py")
def deploy(reboot_on: list[OperationMeta]) -> None:
    """``reboot_on``: the earlier operations whose change needs a reboot (the driver's)."""
    rig = stage.rig()
    if rig["driver"]["source"] == "none" or stage.serves_no_model() or stage.builds_only():
        host.noop("no NVIDIA driver wanted: kernel modules left as they are")
        return
    if not rig["kernel_modules"]["manage"]:
        host.noop("kernel_modules.manage is false: modules, initramfs and reboots left to the host")
        return
    blacklist = operations.atomic_file(
        name="Blacklist nouveau, nova_core and nova",
        src=StringIO(render.render_file("modprobe-blacklist.conf.j2")),
        dest=boot.BLACKLIST_PATH,
        mode="644",
    )
    operations.atomic_file(
        name="Load nvidia and nvidia_uvm at boot (the service needs /dev/nvidia-uvm)",
        src=StringIO(
            render.render_file("modules-load-nvidia.conf.j2", modules=boot.LOADED_AT_BOOT)
        ),
        dest=boot.MODULES_LOAD_PATH,
        mode="644",
    )
    server.shell(
        name="Rebuild the initramfs (the blacklist changed)",
        commands=[boot.REBUILD_INITRAMFS],
        _if=blacklist.did_change,
    )
    needs_reboot = [*reboot_on, blacklist]
    step = boot.reboot_step(
        rig["reboot"],
        local=stage.is_local(),
        may_change=any(operation.will_change for operation in needs_reboot),
    )
    if step.note:
        host.noop(step.note)
    if step.reboot:
        operations.reboot(
            name=step.reboot, _if=any_changed(*needs_reboot) if step.only_if_changed else []
        )
