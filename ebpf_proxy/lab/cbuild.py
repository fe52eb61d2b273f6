"""Compile a C program that ships as package data, once, into a cache keyed by its source's hash.

The lab's native echo server (echod.c) and the bench's load generator (loadgen.c) are small C
programs compiled at run time with the system cc: a wheel stays architecture-free, and an edit
to a source rebuilds it, so nothing stale is ever run. Concurrent builds are safe (the binary
appears by an atomic rename).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path


class BuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ebpf-proxy" / "c"


def build(package: str, source_name: str, libs: tuple[str, ...] = (), cc: str | None = None,
          directory: Path | None = None) -> Path:
    """The path of `source_name` (package data of `package`) compiled, compiling it if this very
    source has not been compiled yet; BuildError naming the source and the compiler's complaint."""
    src = resources.files(package).joinpath(source_name).read_text()
    stem = source_name.rsplit(".", 1)[0]
    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    binary = directory / f"{stem}-{digest}"
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    compiler = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise BuildError(f"no C compiler to build {source_name} (apt-get install gcc)")
    directory.mkdir(parents=True, exist_ok=True)
    src_path = directory / f"{stem}-{digest}.c"
    src_path.write_text(src)
    tmp = directory / f"{stem}-{digest}.{os.getpid()}.tmp"
    done = subprocess.run([compiler, "-O2", "-Wall", "-o", str(tmp), str(src_path), *libs],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"compiling {src_path} with {compiler} failed:\n{done.stderr.strip()}")
    os.replace(tmp, binary)  # atomic: a concurrent build never runs a half-written file
    return binary
