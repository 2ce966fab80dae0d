"""The tests' torch processes (the ranks of a gloo job, a process that saves or loads with torch) as forks of
one server per test worker that imported torch and the training libraries once: each of these processes
spent most of its CPU importing them (torch about 4 s of one core, DeepSpeed 2 s more, megatron-core 6 s),
dozens of times per suite. A fork gets what a fresh process gets: its own pid, the environment and argv the
test gave it, its own stdout/stderr and exit code, no process group or engine of another job; only the
imports are shared, made in the server before it forked (the server runs no torch code and starts no
thread, so the fork is safe).

The server reads one JSON request per line on stdin and answers on stdout: the pids of the forks it started,
then their exit codes once all have exited. It exits when stdin closes (the test worker is gone)."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent


@dataclass
class Rank:
    """One process: `argv[0]` a script path (run as __main__) or "-c" and the source, like python's own."""

    argv: list[str]
    env: dict[str, str]


def _child(rank: dict[str, Any], out_path: str) -> None:
    """In the fork: become the process `python ARGV...` with ENV would have been, then run it and exit."""
    code = 1
    try:
        out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        os.environ.clear()
        os.environ.update(rank["env"])
        argv = rank["argv"]
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            source, filename = argv[1], "<string>"
        else:
            sys.argv = list(argv)
            filename = argv[0]
            source = Path(filename).read_text()
            sys.path.insert(0, str(Path(filename).resolve().parent))
        exec(compile(source, filename, "exec"), {"__name__": "__main__", "__file__": filename})
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter runs at a normal exit (torch.distributed's, ...)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    # The answers go to a pipe of their own: what the libraries print while imported here goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    print("ready", file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        for module in request["preload"]:  # imported here once, so that no fork imports it again
            importlib.import_module(module)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank, out_path in zip(request["ranks"], request["outputs"], strict=True):
            pid = os.fork()
            if pid == 0:
                answers.close()
                _child(rank, out_path)
            pids.append(pid)
        print(json.dumps({"pids": pids}), file=answers, flush=True)
        codes = []
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            codes.append(os.waitstatus_to_exitcode(status))
        print(json.dumps({"codes": codes}), file=answers, flush=True)


class RankServer:
    """The test worker's side: starts the server at the first use and runs ranks in it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""

    def _server(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            # One thread per rank, as the ranks' own OMP_NUM_THREADS could not change it after the import.
            env = dict(os.environ, OMP_NUM_THREADS="1")
            self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          env=env)
            self._buffer = b""
            atexit.register(self.close)
            assert self._read(600) == "ready"
        return self._proc

    def _read(self, timeout: float) -> str:
        """The server's next answer line (the pipe read unbuffered: select() must see what is not read yet)."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"the rank server did not answer within {timeout} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the rank server exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def run(self, ranks: list[Rank], *, preload: tuple[str, ...] = (), timeout: float = 300
            ) -> list[tuple[int, str]]:
        """Start every rank at once, wait for all; (exit code, stdout and stderr) per rank. Ranks still
        running after `timeout` are killed and TimeoutError names what they printed."""
        server = self._server()
        assert server.stdin is not None
        with tempfile.TemporaryDirectory(prefix="ckptfs-ranks-") as tmp:
            outputs = [os.path.join(tmp, f"rank{i}.out") for i in range(len(ranks))]
            request = {"ranks": [{"argv": r.argv, "env": r.env} for r in ranks], "outputs": outputs,
                       "preload": list(preload)}
            server.stdin.write(json.dumps(request).encode() + b"\n")
            server.stdin.flush()
            pids = json.loads(self._read(600))["pids"]
            try:
                answer = self._read(timeout)
            except TimeoutError:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self._read(60)
                raise TimeoutError(f"ranks still running after {timeout} s: "
                                   f"{[Path(o).read_text()[-3000:] for o in outputs]}") from None
            codes = json.loads(answer)["codes"]
            return [(code, Path(out).read_text(errors="replace")) for code, out in zip(codes, outputs, strict=True)]

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None


SERVER = RankServer()  # one per test worker process


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS))
    serve()
