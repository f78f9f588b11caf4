"""Loads the documented defaults of group_data/all.yml as pyinfra group data for all hosts."""

from pathlib import Path as _Path

import yaml as _yaml

globals().update(_yaml.safe_load((_Path(__file__).parent / "all.yml").read_text()))
