"""One host's settings checked whole: the schema first, then (when it passes) the semantic
rules, every problem worded with the file and key path to fix."""

from __future__ import annotations

import copy

from llamarig.config.hosts import HostConfig
from llamarig.config.problems import ConfigError, located
from llamarig.config.rules import semantic_problems
from llamarig.config.schema import schema, schema_problems


def validate_host(host_config: HostConfig) -> list[str]:
    """Schema and cross-field checks of one host; returns the problems found."""
    problems = schema_problems(host_config)
    if not problems:
        problems = [
            located(host_config, problem) for problem in semantic_problems(host_config.data)
        ]
    return problems


def rig_data(host_data: dict) -> dict:
    """The rig keys of pyinfra host data, validated (for deploys run without inventory.py)."""
    keys = schema()["properties"].keys()
    data = {key: copy.deepcopy(host_data[key]) for key in keys if key in host_data}
    host_config = HostConfig("this-host", [], data)
    problems = validate_host(host_config)
    if problems:
        raise ConfigError(problems)
    return data
