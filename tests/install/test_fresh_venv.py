"""Each package installed alone into a fresh venv (its pyproject.toml's dependencies, no test
requirements) imports every one of its modules and starts its commands. This is what the
images do, so a module that imports an undeclared package fails here first.

The operator venv gets kopf at the lowest version its pyproject allows, and applies the kopf
settings the operator needs. The engine venv gets torch==2.13.0 (CPU) and its own dependencies
first, as the Makefile does: linked from this interpreter's installation rather than unpacked
again (that took most of the test's minute and a half), so pip finds them installed and adds
only what the engine's pyproject.toml asks for; the engine's `gpu` extra (triton) is not
installed, so only the Triton kernels (kernels/triton/) may fail to import, and only for lack
of triton.

Slow (pip installs; --no-compile skips writing bytecode); pip's cache is reused."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# Imports every module of a package; prints the ones that fail as `name: ExcType: message`.
IMPORT_ALL = """
import importlib, pkgutil, sys, traceback
package = importlib.import_module(sys.argv[1])
failed = []
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    try:
        importlib.import_module(info.name)
    except BaseException as exc:
        failed.append(f"{info.name}: {type(exc).__name__}: {exc}")
print("\\n".join(failed))
"""


def fresh_venv(where: Path) -> Path:
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(where)], check=True)
    return where / "bin"


@dataclass
class PipInstall:
    """A ``pip install`` into a venv, running in the background."""

    bin_dir: Path
    proc: subprocess.Popen[str]

    def wait(self) -> Path:
        out, err = self.proc.communicate(timeout=600)
        assert self.proc.returncode == 0, out[-2000:] + err[-4000:]
        return self.bin_dir


def start_pip_install(bin_dir: Path, *args: str) -> PipInstall:
    proc = subprocess.Popen([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                             "--no-compile", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return PipInstall(bin_dir, proc)


def failed_imports(bin_dir: Path, package: str) -> dict[str, str]:
    done = subprocess.run([str(bin_dir / "python"), "-c", IMPORT_ALL, package], capture_output=True, text=True,
                          timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(line.split(": ", 1) for line in done.stdout.splitlines() if line)


def help_works(bin_dir: Path, *command: str) -> str:
    done = subprocess.run([str(bin_dir / command[0]), *command[1:], "--help"], capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert done.returncode == 0, f"{' '.join(command)} --help: {done.stderr[-3000:]}"
    return done.stdout


def link_installed(bin_dir: Path, top: str, where: Path) -> list[str]:
    """Put ``top`` and its runtime dependencies, as installed for this interpreter, on the venv's
    path: their files (dist-info included, so pip sees them installed) linked into ``where``,
    which a .pth file in the venv's site-packages adds. Returns the distributions linked."""
    from importlib import metadata

    from packaging.requirements import Requirement

    where.mkdir(parents=True)
    linked, todo = [], [top]
    while todo:
        dist = metadata.distribution(todo.pop())
        name = dist.metadata["Name"]
        if name.lower() in (d.lower() for d in linked):
            continue
        linked.append(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        site = Path(str(dist.locate_file("")))
        for entry in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            if not (where / entry).exists():
                (where / entry).symlink_to(site / entry)
    site_packages = next((bin_dir.parent / "lib").glob("python*/site-packages"))
    (site_packages / "_linked_from_tests.pth").write_text(f"{where}\n")
    return linked


def source_copy(package: str, where: Path) -> Path:
    """The package's folder copied out of the tree, so pip's build leaves nothing in it."""
    return Path(shutil.copytree(ROOT / package, where / package,
                                ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")))


def lowest_allowed(pyproject: Path, dist: str) -> str:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(rf"{dist}\b", d))
    found = re.search(r">=\s*([\d.]+)", spec)
    assert found, f"{spec!r}: give {dist} a lower bound"
    return found.group(1)


@pytest.fixture(scope="module")
def installs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PipInstall]]:
    """Both packages' venvs, their pip installs running at the same time (each mostly waits on
    downloads from the cache and unpacking)."""
    roots = {name: tmp_path_factory.mktemp(f"alone-{name}") for name in ("operator", "engine")}
    bins = {name: fresh_venv(root / "venv") for name, root in roots.items()}
    link_installed(bins["engine"], "torch", roots["engine"] / "torch-site")
    kopf = lowest_allowed(ROOT / "operator/pyproject.toml", "kopf")
    started = {
        "operator": start_pip_install(bins["operator"], f"kopf=={kopf}", str(source_copy("operator", roots["operator"]))),
        "engine": start_pip_install(bins["engine"], str(source_copy("engine", roots["engine"]))),
    }
    yield started
    for install in started.values():
        if install.proc.poll() is None:
            install.proc.kill()
            install.proc.communicate()


def test_operator_alone(installs: dict[str, PipInstall]) -> None:
    bin_dir = installs["operator"].wait()
    assert failed_imports(bin_dir, "tidal_operator") == {}
    assert "operator" in help_works(bin_dir, "tidal", "operator")
    assert "router" in help_works(bin_dir, "tidal", "router")
    check = subprocess.run([str(bin_dir / "python"), "-c", (
        "import kopf, importlib.util as u\n"
        "from tidal_operator.handlers import configure_kopf\n"
        "configure_kopf(kopf.OperatorSettings())\n"
        "assert u.find_spec('torch') is None, 'the operator must not pull in torch'\n")],
        capture_output=True, text=True, timeout=120, cwd="/")
    assert check.returncode == 0, check.stderr[-3000:]


def test_engine_alone(installs: dict[str, PipInstall]) -> None:
    bin_dir = installs["engine"].wait()
    check = subprocess.run([str(bin_dir / "python"), "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True, timeout=120, cwd="/")
    assert check.stdout.strip() == "2.13.0+cpu", check.stderr[-2000:]
    failed = failed_imports(bin_dir, "tidal_engine")
    gpu_extra = {name: why for name, why in failed.items()
                 if name.startswith("tidal_engine.kernels.triton") and "No module named 'triton'" in why}
    assert {k: v for k, v in failed.items() if k not in gpu_extra} == {}
    assert "serve" in help_works(bin_dir, "tidal-engine")
