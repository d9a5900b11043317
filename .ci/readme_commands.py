#!/usr/bin/env python3
"""Runs the README's two commands (the `bash` block of its "Install and run" section) as written, one after the other,
in the repository root, with the python environment this script runs in: what a new user runs (`.ci/run` calls it
inside a fresh virtualenv). Exits with the status of the first command that fails. Standard library only.

    python .ci/readme_commands.py            # run them
    python .ci/readme_commands.py --print    # only print them
"""

import argparse
import os
import re
import subprocess
import sys
import time


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands() -> list[str]:
    """The lines of the first `bash` block after the README's "## Install and run" heading."""
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as file:
        readme = file.read()
    section = readme.split("\n## Install and run\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [line.strip() for line in block.splitlines() if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()
    commands = readme_commands()
    if args.print:
        print("\n".join(commands))
        return 0
    for command in commands:
        print(f"$ {command}", flush=True)
        started = time.time()
        status = subprocess.run(command, shell=True, cwd=REPO_ROOT, executable="/bin/bash").returncode
        print(f"(exit {status} after {time.time() - started:.0f} s)", flush=True)
        if status != 0:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
