"""Loads the documented defaults of group_data/rpc_workers.yml as pyinfra group data."""

from pathlib import Path as _Path

import yaml as _yaml

globals().update(_yaml.safe_load((_Path(__file__).parent / "rpc_workers.yml").read_text()))
