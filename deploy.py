"""llamarig deploy: converge each host of the inventory into a serving llama.cpp rig.

pyinfra inventory.py deploy.py          # RIG_INVENTORY picks the inventory file

The stages run in this order; each returns the operations whose change a later one acts on.
"""

from tasks import (
    cuda,
    driver,
    gateway,
    kernel_modules,
    llama_cpp,
    model,
    preflight,
    repos,
    rpc_worker,
    server,
    verify,
)

preflight.deploy()
repos.deploy()
driver_install = driver.deploy()
kernel_modules.deploy(reboot_on=driver_install)
cuda.deploy()
link = llama_cpp.deploy()
model_download = model.deploy()
worker = rpc_worker.deploy(restart_on=[link])
service = server.deploy(restart_on=[link, *model_download])
verify.deploy(serving=[*worker, *service])
gateway.deploy()
