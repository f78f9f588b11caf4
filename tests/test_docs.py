"""The docs stay true to the code: the variables table is generated, and links resolve."""

import re

import pytest

from llamarig.config import defaults
from scripts import variables_table
from tests.conftest import PROJECT

DOC_FILES = [PROJECT / "README.md", *sorted((PROJECT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def leaf_keys(data: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in ("cmake_options",):
            keys += leaf_keys(value, f"{path}.")
        else:
            keys.append(path)
    return keys


def test_variables_page_covers_every_default():
    page = variables_table.PAGE_PATH.read_text()
    missing = [key for key in leaf_keys(defaults()) if f"`{key}`" not in page]
    assert not missing, f"docs/variables.md lacks these keys of group_data/all.yml: {missing}"


def test_variables_table_is_current():
    page = variables_table.PAGE_PATH.read_text()
    regenerated = variables_table.replace_table(page, variables_table.render_table())
    assert page == regenerated, (
        "docs/variables.md: the variables table is stale (group_data/all.yml or "
        f"llamarig/schema.json changed); run `{variables_table.COMMAND}` and commit the result"
    )


def test_comments_attach_to_the_key_below_them():
    text = (
        "# a file header, not about `top`\n"
        "\n"
        "top:\n"
        "  # about top.inner\n"
        "  # (two lines)\n"
        "  inner: 1\n"
        "  bare: 2\n"
        "  # about top.deeper\n"
        "  deeper:\n"
        "    leaf: 3\n"
        "# about other\n"
        "other: 4\n"
    )
    assert variables_table.comments_above_keys(text) == {
        "top.inner": "about top.inner (two lines)",
        "top.deeper": "about top.deeper",
        "other": "about other",
    }


def test_table_cells_escape_pipes():
    assert variables_table.cell("nvidia-repo | distro") == "nvidia-repo \\| distro"


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as -."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {
        re.sub(r"[^\w\- ]", "", heading).strip().lower().replace(" ", "-") for heading in headings
    }


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda path: path.name)
def test_relative_links_resolve(doc):
    broken = []
    for match in LINK.finditer(doc.read_text()):
        target = match["target"]
        if re.match(r"[a-z]+:", target):
            continue  # an external URL
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(PROJECT)}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(f"{target}: no heading with that anchor in {linked.name}")
    assert not broken, f"{doc.relative_to(PROJECT)}: broken links: {broken}"
