"""Rig configuration: load the Ansible-style YAML inventory, merge defaults, validate.

Every mistake a user can make in the YAML is reported as a :class:`ConfigError` naming the file,
the key path (``hosts.rig1.server.tensor_split``), what is wrong and what would be right, before
any host is contacted.

One job per module, each importable alone (lower ones never import higher ones):

- ``paths``: where the schema, the defaults and the inventory are; ``~`` in local paths
- ``problems``: ``Problem``, ``ConfigError`` and the wording helpers; ``hosts``: the loaded data
- ``loader``: YAML read strictly, size and depth limits, the documented defaults
- ``addresses``: loopback and wildcard addresses; ``derived``: settings derived from others
- ``schema``: the JSON schema and its messages
- ``rules`` (with ``server_rules``, ``model_rules``, ``numbers``), ``contradictions``,
  ``versions``, ``expect``: the semantic rules of one host
- ``shapes``: the shapes of strings that reach a command (addresses, URLs, paths)
- ``validation``: one host checked whole; ``crosshost``: rules across the hosts of an inventory
- ``inventory``: groups, the settings cascade and origins, ``load_inventory``
- ``ssh_trust``: what this machine needs before pyinfra connects (keys, known_hosts);
  ``ssh``: the SSH settings rendered for each client
- ``lock``: models.lock.yml, the resolved references and header records, checked as untrusted
"""

from llamarig.config.addresses import WILDCARD_HOSTS, is_loopback
from llamarig.config.hosts import HostConfig, Inventory
from llamarig.config.inventory import deep_merge, load_inventory
from llamarig.config.loader import defaults, load_yaml
from llamarig.config.paths import DEFAULTS_PATH, SCHEMA_PATH, expand_path, inventory_path
from llamarig.config.problems import ConfigError, Problem
from llamarig.config.schema import schema
from llamarig.config.ssh_trust import connection_problems, strict_host_key_checking
from llamarig.config.validation import rig_data, validate_host
from llamarig.model.files import model_filename

__all__ = [
    "DEFAULTS_PATH",
    "SCHEMA_PATH",
    "WILDCARD_HOSTS",
    "ConfigError",
    "HostConfig",
    "Inventory",
    "Problem",
    "connection_problems",
    "deep_merge",
    "defaults",
    "expand_path",
    "inventory_path",
    "is_loopback",
    "load_inventory",
    "load_yaml",
    "model_filename",
    "rig_data",
    "schema",
    "strict_host_key_checking",
    "validate_host",
]
