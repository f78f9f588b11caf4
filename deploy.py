"""llamarig deploy: converge each host of the inventory into a serving llama.cpp rig.

pyinfra inventory.py deploy.py          # RIG_INVENTORY picks the inventory file
"""

from pyinfra import local

STAGES = (
    "preflight",
    "repos",
    "driver",
    "kernel_modules",
    "cuda",
    "llama_cpp",
    "model",
    "server",
    "verify",
)

for stage in STAGES:
    local.include(f"tasks/{stage}.py")
