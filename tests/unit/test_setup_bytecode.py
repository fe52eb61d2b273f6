"""`make setup` leaves the package's bytecode compiled (scripts/setup.sh: compile_package), as the
image's pip install does: with PYTHONDONTWRITEBYTECODE set (as the image sets it, and as this
machine's shells do) and an editable install, every agent a lab or the bench starts would otherwise
compile each module again, ~0.2 s of CPU while its initial list runs (issue 12: full sync time).
Run `make setup` (or `make test`, which runs it) after adding a module."""

import importlib.util
import pkgutil
from pathlib import Path

import ebpf_proxy

PACKAGE_DIR = Path(ebpf_proxy.__file__).parent


def _modules() -> list[Path]:
    sources = [PACKAGE_DIR / "__init__.py"]
    for info in pkgutil.walk_packages([str(PACKAGE_DIR)], prefix="ebpf_proxy."):
        spec = importlib.util.find_spec(info.name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            sources.append(Path(spec.origin))
    return sources


def test_every_module_of_the_package_has_its_bytecode():
    sources = _modules()
    assert len(sources) > 100  # the walk found the package, not an empty directory
    missing = [str(src.relative_to(PACKAGE_DIR)) for src in sources
               if not Path(importlib.util.cache_from_source(str(src))).exists()]
    assert not missing, f"no .pyc for {len(missing)} module(s), e.g. {missing[:5]}: run `make setup`"
