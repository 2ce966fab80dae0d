"""A real NFS server for the tests: nfs-ganesha (Debian's 4.3, userspace, no kernel NFS server needed) with
its VFS backend, exporting one directory (a ckptfs mount) over NFSv4 only, on 127.0.0.1 at a port of its
own, without rpcbind (the client names the port: libnfs's `nfsport=`). Each Ganesha runs in the foreground
as a child of the test process with its own config, log, pid file and recovery directory under a tmp dir,
and is killed at stop(). The client side is tests/nfsclient.py (libnfs)."""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import nfsclient
from emulators import stop_process

GANESHA = "ganesha.nfsd"
# Debian's package puts the FSAL plugins in /usr/lib/<arch triplet>/ganesha.
PLUGINS = next((p.parent for p in sorted(Path("/usr/lib").glob("*/ganesha/libfsalvfs.so"))),
               Path("/usr/lib/ganesha"))
PR_SET_PDEATHSIG = 1
EXPORT = "/export"


def missing() -> str | None:
    """None when ganesha (with its VFS backend) and libnfs are installed, else what is missing."""
    if shutil.which(GANESHA) is None or not (PLUGINS / "libfsalvfs.so").exists():
        return ("nfs-ganesha with its VFS backend is not installed (scripts/install.sh test installs"
                " nfs-ganesha nfs-ganesha-vfs libnfs-utils)")
    return nfsclient.available()


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills ganesha when the test process ends, however it ends (a test
    run killed or crashed never leaves a server holding a mount open)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CONFIG = """
NFS_CORE_PARAM {{
    Protocols = 4;
    NFS_Port = {port};
    Bind_Addr = 127.0.0.1;
    Enable_NLM = false;
    Enable_RQUOTA = false;
    Enable_UDP = false;
    Plugins_Dir = "{plugins}";
}}
NFS_KRB5 {{ Active_krb5 = false; }}
NFSv4 {{
    # No grace period: a restarted ganesha serves at once (the tests have no state to reclaim).
    Graceless = true;
    RecoveryBackend = fs;
    RecoveryRoot = "{recovery}";
    Only_Numeric_Owners = true;
}}
# No attribute caching in ganesha: every GETATTR asks the exported filesystem, so that the tests see what
# ckptfs answers (and reach inodes the kernel forgot through their file handles).
MDCACHE {{ Dir_Chunk = 0; }}
EXPORT {{
    Export_Id = 1;
    Path = "{path}";
    Pseudo = {export};
    Protocols = 4;
    Transports = TCP;
    Access_Type = RW;
    Squash = No_Root_Squash;
    SecType = sys;
    Attr_Expiration_Time = 0;
    FSAL {{ Name = VFS; {fsal} }}
}}
LOG {{ Default_Log_Level = {level}; }}
"""


class Ganesha:
    """One ganesha.nfsd exporting `path` as nfs://127.0.0.1/export on a port of its own."""

    def __init__(self, root: Path, path: Path, *, level: str = "EVENT", fsal: str = "") -> None:
        self.root = root
        self.path = path
        self.port = free_port()
        self.log = root / "ganesha.log"
        self.config = root / "ganesha.conf"
        self.level = level
        self.fsal = fsal  # more options of the export's FSAL block
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nfs://127.0.0.1{EXPORT}?nfsport={self.port}"

    def client(self) -> nfsclient.Client:
        return nfsclient.Client(self.url)

    def start(self, timeout: float = 30) -> None:
        (self.root / "recovery").mkdir(parents=True, exist_ok=True)
        self.config.write_text(CONFIG.format(
            port=self.port, plugins=PLUGINS, recovery=self.root / "recovery", path=self.path, export=EXPORT,
            level=self.level, fsal=self.fsal))
        with open(self.root / "ganesha.out", "ab") as out:
            self.proc = subprocess.Popen(
                [GANESHA, "-F", "-f", str(self.config), "-L", str(self.log), "-p", str(self.root / "ganesha.pid"),
                 "-N", f"NIV_{self.level}"], stdout=out, stderr=out, start_new_session=True,
                preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ganesha exited with {self.proc.returncode}:\n{self.log_text()}")
            if "NFS SERVER INITIALIZED" in self.log_text():
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"ganesha did not start within {timeout} s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 5 s: its open files on the mount go with it."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, grace=5)

    def restart(self) -> None:
        self.stop()
        self.start()
