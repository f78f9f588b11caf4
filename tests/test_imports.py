"""Every module of the product and of its sandbox imports on its own, no two modules import
each other, and the product reaches the sandbox only through `llamarig sandbox`.

The modules are found by walking llamarig/ and llamarig_sandbox/, so a module added later is
covered without a change here. Each import runs in a fresh interpreter: a cycle that only
works when some other module happens to be imported first fails there. The import graph is
read from the source (imports inside functions included), so a cycle hidden in a function is
refused too.
"""

import ast
import importlib
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
    assert {"llamarig", "llamarig.model.gguf", "llamarig.cli", "llamarig.checks"} <= set(MODULES)
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
    assert graph["llamarig.cli"] >= {
        "llamarig.planner.host_plan",
        "llamarig.planner.gather",
    }  # the graph is read
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


# The layers, lowest first: each folder of llamarig/ holds one kind of thing and imports only
# from its own folder and the folders before it (docs/architecture.md draws the same table).
LAYERS = (
    "tables",  # facts of the world and pure rules: import nothing of llamarig
    "onhost",  # what llamarig keeps on a host and how it talks to it
    "model",  # how a model is named, resolved, split, and what its GGUF header says
    "config",  # the rig data: loaded, validated, locked
    "facts",  # what is read from a host
    "planner",  # gathered inputs -> the plan -> what is rendered for the host
    "serving",  # features of a rig that serves: pace, answers, status, tuning
    "operations",  # what changes a host, reading facts first
    "converge",  # what the deploy's stages share and decide
    "checks",  # the testinfra suite and `llamarig verify`
    "cli",  # the command line, over all of it
)
# Top-level modules of llamarig besides the layers' folders.
TOP_MODULES = {"llamarig", "llamarig.cli"}


def _layer(name: str) -> str | None:
    """The layer of a product module (None: the package itself, the lowest of all)."""
    parts = name.split(".")
    if parts[0] != "llamarig" or len(parts) == 1:
        return None
    return parts[1]


PRODUCT = sorted(name for name in MODULES if name.startswith("llamarig.") or name == "llamarig")


def test_every_module_lives_in_a_layer():
    strays = [name for name in PRODUCT if name not in TOP_MODULES and _layer(name) not in LAYERS]
    assert not strays, (
        f"modules outside the layers' folders (tests/test_imports.py LAYERS): {strays}"
    )
    for layer in LAYERS[:-1]:
        docstring = ast.get_docstring(
            ast.parse((PROJECT / "llamarig" / layer / "__init__.py").read_text())
        )
        assert docstring, f"llamarig/{layer}/__init__.py says nothing of the folder's one job"


def test_imports_go_down_the_layers_only():
    upward = []
    for name in PRODUCT:
        layer = _layer(name)
        if layer is None:
            continue
        rank = LAYERS.index(layer) if layer in LAYERS else len(LAYERS)
        for imported in sorted(_imported_modules(name)):
            if imported.startswith("llamarig_sandbox"):
                continue  # the CLI's `sandbox` verb (test_only_the_cli_reaches_the_sandbox)
            target = _layer(imported)
            if target is not None and LAYERS.index(target) > rank:
                upward.append(f"{name} ({layer}) imports {imported} ({target})")
    assert not upward, "imports that run up the layers:\n  " + "\n  ".join(upward)


def test_the_tables_import_nothing_of_llamarig():
    borrowing = {
        name: sorted(_imported_modules(name))
        for name in PRODUCT
        if _layer(name) == "tables" and _imported_modules(name)
    }
    assert not borrowing


def test_nothing_of_the_product_imports_the_stages():
    """tasks/ are the deploy's stages: they use llamarig, never the other way round."""
    for name in PRODUCT:
        tree = ast.parse(MODULES[name].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert not (node.module or "").startswith("tasks"), f"{name} imports tasks"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("tasks") for a in node.names), name


def test_no_folder_imports_one_that_imports_it_back():
    folders: dict[str, set[str]] = {}
    for name in PRODUCT:
        layer = _layer(name) or "llamarig"
        folders.setdefault(layer, set())
        for imported in _imported_modules(name):
            target = _layer(imported) or "llamarig"
            if target != layer and not imported.startswith("llamarig_sandbox"):
                folders[layer].add(target)
    for targets in folders.values():
        for target in targets:
            folders.setdefault(target, set())
    cycle = _cycle(folders)
    assert cycle is None, "a circle of folders: " + " -> ".join(cycle or [])


# Modules whose tests cannot run here (the GPU suite skips itself before its imports without a
# GPU) or that only a benchmark runs: their imports of the project are resolved here instead.
UNRUN = sorted([*(PROJECT / "tests" / "gpu").glob("*.py"), *(PROJECT / "bench").glob("*.py")])


@pytest.mark.parametrize("path", UNRUN, ids=lambda path: str(path.relative_to(PROJECT)))
def test_what_a_gpu_test_or_benchmark_imports_exists(path):
    missing = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module.split(".")[0] not in ("llamarig", "llamarig_sandbox", "bench"):
            continue
        module = importlib.import_module(node.module)
        for alias in node.names:
            if not hasattr(module, alias.name):
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ModuleNotFoundError:
                    missing.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    assert not missing, f"{path.name} imports what the project does not have: {missing}"
