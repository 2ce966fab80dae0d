"""pip's settings on this machine as the options of `uv pip install`, one a line (uv reads neither pip.conf nor
PIP_* variables). Which index, extra indexes, find-links directories, constraints and trusted hosts pip would
use comes from `pip config list` (files and environment, env > [install] > [global]), so uv resolves against the
same sources: a wheel that lies on local disk (find-links) is found by uv as it is by pip.
Run with the venv's python: python scripts/uv-options.py"""

import shlex
import subprocess
import sys

# pip option -> uv option; the multi-valued ones take whitespace-separated lists, as in pip.conf
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
SECTION_RANK = {"global": 0, "install": 1, ":env:": 2}


def main() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    chosen: dict[str, tuple[int, str]] = {}
    no_index = False
    for line in listing.splitlines():
        key, sep, raw = line.partition("=")
        section, _, name = key.rpartition(".")
        if not sep or section not in SECTION_RANK:
            continue
        value = " ".join(shlex.split(raw))
        rank = SECTION_RANK[section]
        if name == "no-index":
            no_index = value.lower() in ("1", "true", "yes", "on")
        elif name in OPTIONS and rank >= chosen.get(name, (-1, ""))[0]:
            chosen[name] = (rank, value)
    if no_index:
        print("--no-index")
    for name, (_, value) in chosen.items():
        for item in value.split():
            print(OPTIONS[name])
            print(item)


if __name__ == "__main__":
    main()
