"""Every module of the product and of its sandbox imports on its own, no two modules import
each other, and the product reaches the sandbox only through `llamarig sandbox`.

The modules are found by walking llamarig/ and llamarig_sandbox/, so a module added later is
covered without a change here. Each import runs in a fresh interpreter: a cycle that only
works when some other module happens to be imported first fails there. The import graph is
read from the source (imports inside functions included), so a cycle hidden in a function is
refused too.
"""

import ast
import subprocess
import sys

import pytest

from tests.conftest import PROJECT, offline

PACKAGES = ("llamarig", "llamarig_sandbox")


def _module_name(path) -> str:
    parts = list(path.relative_to(PROJECT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {
    _module_name(path): path
    for package in PACKAGES
    for path in sorted((PROJECT / package).rglob("*.py"))
}


@pytest.fixture(scope="module")
def imports():
    """One fresh interpreter per module, all started at once (the imports take seconds)."""
    started = {
        name: subprocess.Popen(
            offline([sys.executable, "-c", f"import {name}"]),
            cwd=PROJECT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in MODULES
    }
    yield started
    for process in started.values():
        process.kill()
        process.wait()


def test_the_walk_finds_the_package_and_its_subpackages():
    assert {"llamarig", "llamarig.gguf_header", "llamarig.cli", "llamarig.checks"} <= set(MODULES)
    assert {"llamarig.config.rules", "llamarig_sandbox.sandbox"} <= set(MODULES)
    assert all(name.split(".")[0] in PACKAGES for name in MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports_in_a_fresh_interpreter(imports, name):
    output, _ = imports[name].communicate(timeout=120)
    assert imports[name].returncode == 0, f"python -c 'import {name}' failed:\n{output}"


def _imported_modules(name: str) -> set[str]:
    """The package's modules that ``name``'s source imports, anywhere in it; a module's own
    parent packages are left out (importing a module always imports them first)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return (found & MODULES.keys()) - parents - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as the path that closes it, or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        for imported in sorted(graph[name]):
            cycle = visit(imported, [*path, name])
            if cycle:
                return cycle
        done.add(name)
        return None

    return next(filter(None, (visit(name, []) for name in sorted(graph))), None)


def test_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_imports_one_that_imports_it_back():
    graph = {name: _imported_modules(name) for name in MODULES}
    assert graph["llamarig.cli"] >= {"llamarig.plan", "llamarig.remote"}  # the graph is read
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_only_the_cli_reaches_the_sandbox():
    """The product runs without its test rig: no module but the CLI's `sandbox` command
    imports llamarig_sandbox."""
    reaching = {
        name
        for name in MODULES
        if name.startswith("llamarig.")
        and any(imported.startswith("llamarig_sandbox") for imported in _imported_modules(name))
    }
    assert reaching == {"llamarig.cli"}
