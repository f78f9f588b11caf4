"""The README's variable table documents every default of group_data/all.yml."""

from llamarig.config import defaults
from tests.conftest import PROJECT


def leaf_keys(data: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in ("cmake_options",):
            keys += leaf_keys(value, f"{path}.")
        else:
            keys.append(path)
    return keys


def test_readme_table_covers_every_default():
    readme = PROJECT.joinpath("README.md").read_text()
    missing = [key for key in leaf_keys(defaults()) if f"`{key}`" not in readme]
    assert not missing, f"README.md lacks these keys of group_data/all.yml: {missing}"
