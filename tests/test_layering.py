"""The layout rules of docs/ARCHITECTURE.md, checked.

- Dependencies: a package (or top-level module) imports only the layers below it (ALLOWED); there is no
  cycle between packages. Only mount/adapter.py and daemon/ (running.py, startup.py) import pyfuse3; only
  backends/ import a cloud SDK.
- Names: no two modules share a basename, and no two classes a name (a Protocol is named for its role, not
  for the class that implements it).
- Privates: no module reaches into another's private names (`from x import _y`, `other._y`).
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckptfs"

# Each layer and the layers it may import, lowest first.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "checksums": set(),
    "config": {"errors"},
    "journal": set(),
    "cache": {"config", "errors", "journal"},
    "backends": {"checksums", "errors"},
    "transfer": {"backends", "checksums", "errors"},
    "fetch": {"backends", "cache", "checksums", "config", "errors", "journal", "transfer"},
    "nodes": {"errors", "journal", "transfer"},
    "fs": {"cache", "errors", "journal"},
    "retention": {"errors", "fetch", "fs", "journal", "nodes"},
    "drain": {"backends", "cache", "errors", "journal", "retention", "transfer"},
    "notices": {"config", "drain", "transfer"},
    "control": {"backends", "cache", "config", "drain", "errors", "fetch", "fs", "journal", "nodes", "notices",
                "retention", "transfer"},
    "mount": {"control", "errors", "fs", "journal"},
    "keepmount": {"control", "errors", "fs", "mount"},
    "daemon": {"backends", "cache", "config", "control", "drain", "errors", "fetch", "fs", "journal", "keepmount",
               "mount", "nodes", "notices", "retention", "transfer"},
    "cli": {"config", "control", "daemon", "errors", "keepmount", "mount"},
    "__main__": {"cli"},
    "__init__": {"control", "errors"},
}
PYFUSE3_MODULES = {"mount/adapter.py", "daemon/running.py", "daemon/startup.py"}
CLOUD_SDKS = {"boto3", "botocore", "google", "azure", "s3transfer"}
# Underscore names that are public API: a NamedTuple's methods, and the few private names of the standard
# library and of the SDKs (google-cloud-storage; botocore and urllib3 under a ranged GET) that have no public
# spelling.
PUBLIC_UNDERSCORE = {"_replace", "_fields", "_asdict", "_make", "_exit", "_Environ"}
THIRD_PARTY_PRIVATE = {("backends/gcswire.py", "_credentials"), ("backends/gcswire.py", "_http"),
                       ("backends/s3wire.py", "_raw_stream"), ("backends/s3wire.py", "_fp")}


def _modules() -> list[Path]:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 10
    return modules


def _internal_imports(path: Path) -> set[str]:
    """The layers of ckptfs a module imports: `ckptfs.x.y` and `from ckptfs import x` both name layer x."""
    layers = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
            if node.module == "ckptfs":
                names = [f"ckptfs.{alias.name}" for alias in node.names]
        layers.update(name.split(".")[1] for name in names if name.startswith("ckptfs."))
    return layers


def _top_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _layer(path: Path) -> str:
    # A subpackage (backends/, drain/, ...) is one layer: its modules may import each other.
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def test_dependency_rule() -> None:
    for module in _modules():
        layer = _layer(module)
        assert layer in ALLOWED, f"{module.name}: add its layer to the rule in docs/ARCHITECTURE.md and here"
        internal = _internal_imports(module) - {layer}
        assert internal <= ALLOWED[layer], f"{module}: imports {internal - ALLOWED[layer]}"
        top = _top_imports(module)
        relative = str(module.relative_to(PACKAGE))
        if "pyfuse3" in top:
            assert relative in PYFUSE3_MODULES, f"{module} imports pyfuse3"
        if top & CLOUD_SDKS:
            assert layer == "backends", f"{module} imports a cloud SDK"


def test_rule_has_no_cycle() -> None:
    """The rule itself is a partial order: following ALLOWED never comes back to where it started."""
    def below(layer: str, seen: tuple[str, ...]) -> None:
        for lower in ALLOWED[layer]:
            assert lower not in seen, f"cycle: {' -> '.join((*seen, lower))}"
            below(lower, (*seen, lower))
    for layer in ALLOWED:
        below(layer, (layer,))


def test_every_layer_is_a_package_or_module_here() -> None:
    present = {_layer(module) for module in _modules()}
    assert set(ALLOWED) == present


def test_no_two_modules_or_classes_share_a_name() -> None:
    modules: dict[str, list[str]] = collections.defaultdict(list)
    classes: dict[str, list[str]] = collections.defaultdict(list)
    for module in _modules():
        relative = str(module.relative_to(PACKAGE))
        if module.name != "__init__.py":
            modules[module.name].append(relative)
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name].append(relative)
    assert {name: where for name, where in modules.items() if len(where) > 1} == {}
    assert {name: where for name, where in classes.items() if len(where) > 1} == {}


def test_no_module_reaches_into_another_modules_privates() -> None:
    found = []
    for module in _modules():
        relative = str(module.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ckptfs"):
                found += [f"{relative}: from {node.module} import {alias.name}"
                          for alias in node.names if alias.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if node.attr in PUBLIC_UNDERSCORE or (relative, node.attr) in THIRD_PARTY_PRIVATE:
                    continue
                found.append(f"{relative}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
