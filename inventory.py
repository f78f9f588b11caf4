"""pyinfra inventory: the hosts of the Ansible-style YAML file named by RIG_INVENTORY.

Every host's data is merged over group_data/all.yml and validated before pyinfra connects,
and models.lock.yml beside the inventory checked; a mistake stops here with the file, the key
path (or the lock's entry) and the fix.
"""

import sys

from llamarig.config import ConfigError, connection_problems, load_inventory
from llamarig.config.lock import lock_problems
from llamarig.config.ssh import pyinfra_host

try:
    _inventory = load_inventory()
    # models.lock.yml beside it too: a lock that is not one, or a record that lies, is refused
    # here, before pyinfra connects (a dry run too).
    _problems = connection_problems(_inventory) + lock_problems()
    if _problems:
        raise ConfigError(_problems)
except ConfigError as _error:
    print("llamarig: the rig configuration is not valid:", file=sys.stderr)
    for _problem in _error.problems:
        print(f"  {_problem}", file=sys.stderr)
    sys.exit(2)

for _group, _members in _inventory.groups.items():
    globals()[_group] = [pyinfra_host(_inventory.hosts[name]) for name in _members]
