"""Each package installed alone into a fresh venv (its pyproject.toml's dependencies, no test
requirements) imports every one of its modules and starts its commands. This is what the
images do, so a module that imports an undeclared package fails here first.

The operator venv gets kopf at the lowest version its pyproject allows, and applies the kopf
settings the operator needs. The engine venv gets torch==2.13.0 (CPU, from local disk) first,
as the Makefile does; the engine's `gpu` extra (triton) is not installed, so only the Triton
kernels (kernels/triton/) may fail to import, and only for lack of triton.

Slow (mostly unpacking torch; --no-compile skips writing bytecode for it); pip's cache is reused."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
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


def pip_install(bin_dir: Path, *args: str) -> None:
    done = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                           *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


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


def test_operator_alone(tmp_path: Path) -> None:
    bin_dir = fresh_venv(tmp_path / "venv")
    kopf = lowest_allowed(ROOT / "operator/pyproject.toml", "kopf")
    pip_install(bin_dir, f"kopf=={kopf}", str(source_copy("operator", tmp_path)))
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


def test_engine_alone(tmp_path: Path) -> None:
    bin_dir = fresh_venv(tmp_path / "venv")
    pip_install(bin_dir, "torch==2.13.0")
    pip_install(bin_dir, str(source_copy("engine", tmp_path)))
    failed = failed_imports(bin_dir, "tidal_engine")
    gpu_extra = {name: why for name, why in failed.items()
                 if name.startswith("tidal_engine.kernels.triton") and "No module named 'triton'" in why}
    assert {k: v for k, v in failed.items() if k not in gpu_extra} == {}
    assert "serve" in help_works(bin_dir, "tidal-engine")
