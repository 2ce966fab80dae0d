"""The dependency rule of DESIGN.md, checked: lower layers never import higher ones; only fuse_ops.py and
daemon.py import pyfuse3; only backends/ import a cloud SDK."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckptfs"

ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "journal": set(),
    "cache": {"config", "errors"},
    "evict": {"cache", "errors", "journal"},
    "systemd": set(),
    "process": set(),
    "metrics": set(),
    "retention": set(),
    "snapshot": {"backends", "cache", "drain", "errors", "evict", "fetch", "fs", "journal", "metrics", "nodes",
                 "transfer"},
    "control": {"config", "drain", "errors", "journal", "lister", "nodes", "preempter", "pruner", "snapshot",
                "transfer"},
    "preempter": {"drain", "transfer"},
    "notices": {"config", "preempter"},
    "pruner": {"errors", "fs", "journal", "lister", "nodes", "retention"},
    "checksums": set(),
    "backends": {"checksums", "errors", "backends"},
    "memory": set(),
    "leftovers": {"backends", "errors"},
    "local_io": {"backends", "checksums", "errors"},
    "transfer": {"backends", "checksums", "errors", "leftovers", "local_io", "memory"},
    "fetch": {"backends", "cache", "checksums", "errors", "evict", "journal", "transfer"},
    "drain": {"backends", "cache", "errors", "journal", "local_io", "retention", "transfer"},
    "recovery": {"backends", "cache", "errors", "journal", "transfer"},
    "lister": {"backends", "cache", "errors", "journal", "transfer"},
    "nodes": {"backends", "errors", "journal", "transfer"},
    "fs": {"cache", "errors", "evict", "handles", "journal"},
    "fuse_ops": {"errors", "fs", "journal", "metrics"},
    "client": {"errors"},
    "ctl": {"client", "errors"},
    "handles": set(),
    "holder": {"client", "errors"},
    "holder_link": {"errors", "holder"},
    "guard": {"client", "errors"},
    "mountpoint": {"errors", "guard", "holder"},
    "takeover": {"errors", "fs", "guard", "handles", "holder", "holder_link", "mountpoint", "systemd"},
    "daemon": {"backends", "cache", "client", "config", "control", "ctl", "drain", "errors", "evict", "fetch", "fs",
               "fuse_ops", "guard", "handles", "holder", "holder_link", "journal", "lister", "metrics", "mountpoint",
               "nodes", "notices", "preempter", "process", "pruner", "recovery", "snapshot", "systemd", "takeover",
               "transfer"},
    "cli": {"client", "config", "daemon", "errors", "takeover"},
    "__main__": {"cli"},
    "__init__": {"client", "errors"},
}
CLOUD_SDKS = {"boto3", "botocore", "google", "azure", "s3transfer"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _layer(path: Path) -> str:
    # A subpackage (backends/, drain/, ...) is one layer: its modules may import each other.
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def test_dependency_rule() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 10
    for module in modules:
        layer = _layer(module)
        assert layer in ALLOWED, f"{module.name}: add its layer to the rule in DESIGN.md and here"
        imported = _imports(module)
        internal = {name.split(".")[1] for name in imported if name.startswith("ckptfs.")}
        assert internal <= ALLOWED[layer] | {layer}, f"{module}: imports {internal - ALLOWED[layer]}"
        top = {name.split(".")[0] for name in imported}
        if "pyfuse3" in top:
            assert layer in ("fuse_ops", "daemon"), f"{module} imports pyfuse3"
        if top & CLOUD_SDKS:
            assert layer == "backends", f"{module} imports a cloud SDK"
