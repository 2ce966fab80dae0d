"""The promise of scripts/build-wheels.sh (issue 43): `pip install dist/*.whl` into a fresh venv gives a
ckptfs with FUSE passthrough on a machine that has no /opt/ckptfs-fuse, because the pyfuse3 wheel carries
its libfuse 3.17 inside and finds it relative to itself, and its manylinux tag names the glibc it needs.

The machine without /opt/ckptfs-fuse is this one, in a mount namespace of its own with an empty tmpfs over
the prefix (the other tests, running beside this one, keep theirs), and a PID namespace of its own: when the
check ends, however it ends, every process it started (the daemon, its holder) ends with it, and the FUSE
mount with them."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pyfuse3
import pytest

REPO = Path(__file__).resolve().parent.parent
PREFIX = Path("/opt/ckptfs-fuse")


def _why_no_wheel() -> str | None:
    """Why the pyfuse3 wheel cannot be made on this machine (None: it can)."""
    if os.geteuid() != 0:
        return "scripts/build-wheels.sh needs root (scripts/build-fuse.sh builds libfuse 3.17 into /opt)"
    if not getattr(pyfuse3, "PASSTHROUGH_BUILD", False) or not (PREFIX / "lib" / "libfuse3.so.4").exists():
        return ("scripts/build-fuse.sh could not build the patched pyfuse3 here and fell back to the stock one"
                " (.build/build-fuse.log): there is no wheel to pack")
    return None


NO_WHEEL = _why_no_wheel()
pytestmark = pytest.mark.skipif(NO_WHEEL is not None, reason=NO_WHEEL or "")


def _kernel_has_passthrough() -> bool:
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 9)


def _run(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def _build_wheels() -> tuple[Path, Path]:
    """The script's wheels in dist/ (quick when they are there already): ckptfs's and pyfuse3's."""
    _run("bash", REPO / "scripts" / "build-wheels.sh", timeout=900)
    dist = REPO / "dist"
    package = sorted(dist.glob("ckptfs-*.whl"))
    binary = sorted(dist.glob("pyfuse3-*.whl"))
    assert len(package) == 1 and len(binary) == 1, sorted(p.name for p in dist.iterdir())
    assert package[0].name.endswith("-py3-none-any.whl")
    return package[0], binary[0]


def _newest_glibc(*elf_files: Path) -> tuple[int, int]:
    """The newest glibc version any of these files needs a symbol of (their undefined, versioned symbols)."""
    newest = (2, 0)
    for path in elf_files:
        symbols = _run("readelf", "--dyn-syms", "--wide", path).stdout
        for line in symbols.splitlines():
            if " UND " in line:
                for major, minor in re.findall(r"@GLIBC_(\d+)\.(\d+)", line):
                    newest = max(newest, (int(major), int(minor)))
    return newest


def _rpath(elf: Path) -> str:
    dynamic = _run("readelf", "-d", elf).stdout
    found = re.findall(r"\((?:RPATH|RUNPATH)\).*\[(.*)\]", dynamic)
    assert len(found) == 1, dynamic
    return found[0]


def test_the_pyfuse3_wheel_carries_its_libfuse_and_tells_its_glibc(tmp_path: Path) -> None:
    _, binary = _build_wheels()
    with zipfile.ZipFile(binary) as wheel:
        names = wheel.namelist()
        wheel.extractall(tmp_path)
    libs = [n for n in names if re.fullmatch(r"pyfuse3\.libs/libfuse3[-.\w]*\.so[.\d]*", n)]
    extensions = [n for n in names if re.fullmatch(r"pyfuse3/__init__\.cpython-[^/]*\.so", n)]
    assert len(libs) == 1 and len(extensions) == 1, names
    extension, lib = tmp_path / extensions[0], tmp_path / libs[0]

    # the extension loads the bundled library, found relative to itself, and nothing from the build machine
    rpath = _rpath(extension)
    assert all(entry.startswith("$ORIGIN") for entry in rpath.split(":")), rpath
    assert "/opt" not in rpath and "/root" not in rpath, rpath
    needed = re.findall(r"\(NEEDED\).*\[(.*)\]", _run("readelf", "-d", extension).stdout)
    assert lib.name in needed and not any(n.startswith("libfuse3.so") for n in needed), needed

    # the platform tag says the glibc the wheel needs: the newest versioned symbol it uses, not older
    tag = re.search(r"-manylinux_(\d+)_(\d+)_x86_64\.whl$", binary.name)
    assert tag, binary.name
    assert (int(tag[1]), int(tag[2])) == _newest_glibc(extension, lib), binary.name


def test_pip_install_of_the_wheels_mounts_with_passthrough_without_the_prefix(tmp_path: Path) -> None:
    wheels = _build_wheels()
    venv = tmp_path / "venv"
    uv = Path(sys.executable).parent / "uv"
    if uv.exists():  # seconds instead of pip's tens of seconds; the same indexes as pip (scripts/uv-options.py)
        options = _run(sys.executable, REPO / "scripts" / "uv-options.py").stdout.splitlines()
        _run(uv, "venv", "-q", "--python", sys.executable, venv)
        _run(uv, "pip", "install", "-q", "--python", venv / "bin" / "python", *options, *wheels, timeout=600)
    else:
        _run(sys.executable, "-m", "venv", venv)
        _run(venv / "bin" / "pip", "install", "-q", *wheels, timeout=600)

    (tmp_path / "bucket").mkdir()
    (tmp_path / "mnt").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "payload").write_bytes(PAYLOAD)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(tmp_path / "run"))
    env.pop("PYTHONPATH", None)  # the venv's ckptfs, not this checkout's
    # bash stays PID 1 of the namespace, which reaps the daemon once it exits (its parent, the CLI, is gone):
    # hence no exec of the driver (bash would exec a lone last command).
    hide_prefix = f'mount -t tmpfs -o size=1m,mode=755 ckptfs-test-hidden {PREFIX} || exit 97; "$@"; exit $?'
    result = subprocess.run(
        ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--",
         "bash", "-c", hide_prefix, "bash", str(venv / "bin" / "python"), str(driver), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=180,
    )
    log = tmp_path / "cache" / "ckptfs.log"
    context = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}\ndaemon log:\n" + (
        log.read_text(errors="replace") if log.exists() else "(none)")
    assert result.returncode == 0, context
    report = json.loads(result.stdout.splitlines()[-1])

    assert report["prefix_listing"] == [], context  # the prefix was hidden
    site = str(venv / "lib")
    assert report["pyfuse3"].startswith(site) and report["passthrough_build"], context
    libfuse = [line for line in report["ldd"].splitlines() if "libfuse3" in line]
    assert len(libfuse) == 1, report["ldd"]
    name, _, where = libfuse[0].strip().partition(" => ")
    assert re.fullmatch(r"libfuse3[-.\w]*\.so[.\d]*", name), libfuse
    assert where.startswith(site) and "pyfuse3.libs/" in where, libfuse

    passthrough = report["status"]["passthrough"]
    if _kernel_has_passthrough():
        assert passthrough["enabled"] and passthrough["why"].startswith("on:"), passthrough
    else:  # the wheel is the patched build all the same: only the kernel says no
        assert "stock build" not in passthrough["why"], passthrough
    assert report["status"]["keep_mount"]["holder_pid"], report["status"]["keep_mount"]
    assert report["status"]["states"]["clean"] == {"files": 1, "bytes": len(PAYLOAD)}, report["status"]
    assert (tmp_path / "bucket" / "f").read_bytes() == PAYLOAD
    bad = [line for line in log.read_text().splitlines() if " WARNING " in line or " ERROR " in line]
    assert not bad, context


PAYLOAD = b"checkpoint bytes from the wheel\n" * 1000

# Runs in the namespaces, by the venv's python, with /opt/ckptfs-fuse hidden; prints what it saw as one JSON
# line. It imports pyfuse3 itself: a pyfuse3 that could not load its libfuse fails here already. Its argument:
# the test's tmp dir (bucket/, mnt/, payload; cache/ is made by the mount).
DRIVER = f"""
import json, os, subprocess, sys
from pathlib import Path

import pyfuse3

tmp = Path(sys.argv[1])
ckptfs = str(Path(sys.executable).parent / "ckptfs")
mnt, bucket, cache = tmp / "mnt", tmp / "bucket", tmp / "cache"


def run(*args):
    result = subprocess.run([ckptfs, *args], capture_output=True, text=True, timeout=90)
    if result.returncode != 0:
        raise SystemExit(f"ckptfs {{' '.join(args)}} exited {{result.returncode}}: {{result.stderr}}")
    return result.stdout


report = {{
    "prefix_listing": os.listdir({str(PREFIX)!r}),
    "pyfuse3": pyfuse3.__file__,
    "passthrough_build": bool(getattr(pyfuse3, "PASSTHROUGH_BUILD", False)),
    "ldd": subprocess.run(["ldd", pyfuse3.__file__], capture_output=True, text=True, check=True).stdout,
}}
run("mount", f"file://{{bucket}}", str(mnt), "--daemon", "--cache-dir", str(cache), "--metrics-addr", "off",
    "--upload-delay", "0")
try:
    (mnt / "f").write_bytes((tmp / "payload").read_bytes())
    run("flush", str(mnt), "--timeout", "60")
    report["status"] = json.loads(run("status", str(mnt), "--json"))
finally:
    # a failure above stays the one reported (the namespace's end stops the daemon all the same)
    umount = subprocess.run([ckptfs, "umount", str(mnt), "--timeout", "60"], capture_output=True, text=True,
                            timeout=90)
if umount.returncode != 0:
    raise SystemExit(f"ckptfs umount exited {{umount.returncode}}: {{umount.stderr}}")
print(json.dumps(report))
"""
