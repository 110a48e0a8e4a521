"""The Dockerfile, checked statically (no Docker engine here, so it can't be built): the two
targets exist, every COPY source exists and survives .dockerignore, the entrypoints are the
packages' console scripts, the images run as the non-root UIDs the operator and chart expect,
and the operator image stays free of torch."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, op: str) -> str | None:
        found = [arg for o, arg in self.instructions if o == op]
        return found[-1] if found else None

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped (as BuildKit does)."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        op, _, arg = line.partition(" ")
        out.append((op.upper(), arg.strip()))
    assert not pending, "a trailing backslash"
    return out


def parse() -> tuple[dict[str, str], dict[str, Stage]]:
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for op, arg in instructions(DOCKERFILE.read_text()):
        if op == "ARG" and current is None:
            key, _, default = arg.partition("=")
            global_args[key] = default.strip('"')
        elif op == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", arg, re.I)
            assert m, arg
            base = re.sub(r"\$\{(\w+)\}", lambda g: global_args[g.group(1)], m.group(1))
            current = Stage(m.group(2) or str(len(stages)), base)
            stages[current.name] = current
        else:
            assert current is not None, f"{op} before FROM"
            current.instructions.append((op, arg))
    return global_args, stages


def exec_form(arg: str) -> list[str]:
    value = json.loads(arg)
    assert isinstance(value, list), f"use the exec (JSON) form: {arg}"
    return value


def console_scripts(package: str) -> dict[str, str]:
    return tomllib.loads((ROOT / package / "pyproject.toml").read_text())["project"]["scripts"]


# --- .dockerignore, as Docker reads it: the last matching pattern wins, "!" re-includes. ------

def ignore_patterns() -> list[tuple[bool, str]]:
    patterns: list[tuple[bool, str]] = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        patterns.append((negate, line.lstrip("!").strip("/")))
    return patterns


def _matches(pattern: str, path: str) -> bool:
    # A pattern matches the path or any parent directory of it; "**" spans directories.
    parts = path.split("/")
    regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
    return any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1))


def is_excluded(path: str) -> bool:
    excluded = False
    for negate, pattern in ignore_patterns():
        if _matches(pattern, path):
            excluded = not negate
    return excluded


# --- tests ----------------------------------------------------------------------------------

def test_both_targets_exist_on_the_right_bases() -> None:
    global_args, stages = parse()
    assert {"engine", "operator"} <= set(stages)
    assert stages["operator"].base.startswith("python:3.11-slim")
    # The engine runs on a CUDA runtime image (torch brings its CUDA libraries; the base, the driver glue).
    assert re.fullmatch(r"nvidia/cuda:12\.\d+(\.\d+)?-runtime-ubuntu\d\d\.\d\d", stages["engine"].base)
    assert stages["engine-build"].base == stages["engine"].base  # the venv is copied across: same Python


def test_every_copy_source_exists_and_is_in_the_build_context() -> None:
    _, stages = parse()
    names = list(stages)
    copies = 0
    for index, stage in enumerate(stages.values()):
        for arg in stage.all("COPY") + stage.all("ADD"):
            words = shlex.split(arg)
            flags = [w for w in words if w.startswith("--")]
            sources = [w for w in words if not w.startswith("--")][:-1]
            assert sources, arg
            source_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            if source_stage is not None:
                assert source_stage in names[:index], f"COPY --from={source_stage}: no earlier stage"
                continue
            for src in sources:
                copies += 1
                path = ROOT / src
                assert path.exists(), f"COPY {src}: not in the repository"
                assert not is_excluded(src), f"COPY {src}: excluded by .dockerignore"
                if path.is_dir():
                    # The package's Python files must reach the image too.
                    py = [p.relative_to(ROOT).as_posix() for p in path.rglob("*.py") if "__pycache__" not in p.parts]
                    assert py and not [p for p in py if is_excluded(p)], src
    assert copies >= 4


def test_dockerignore_keeps_out_what_images_must_not_hold() -> None:
    for path in (".venv/bin/python", ".git/config", ".tidal/dev/kubeconfig", "tests/install/test_chart.py",
                 "engine/tidal_engine/__pycache__/x.pyc", "operator/tidal_operator.egg-info/PKG-INFO",
                 "benchmarks/results.json", "charts/tidal/values.yaml"):
        assert is_excluded(path), path
    for path in ("engine/pyproject.toml", "engine/tidal_engine/cli.py", "operator/tidal_operator/labels.py"):
        assert not is_excluded(path), path


@pytest.mark.parametrize("target, package, command", [("engine", "engine", "tidal-engine"),
                                                      ("operator", "operator", "tidal")])
def test_entrypoint_is_the_packages_console_script(target: str, package: str, command: str) -> None:
    _, stages = parse()
    entrypoint = exec_form(stages[target].last("ENTRYPOINT") or "null")
    assert entrypoint == [command]
    scripts = console_scripts(package)
    assert command in scripts, f"{package}/pyproject.toml has no [project.scripts] {command}"
    # The script's module is inside the sources the image copies.
    module = scripts[command].split(":")[0]
    top = module.split(".")[0]
    assert any(f"{package}/{top}" in arg for arg in stages[f"{target}-build"].all("COPY"))


@pytest.mark.parametrize("package", ["engine", "operator"])
def test_console_script_targets_exist(package: str) -> None:
    module, _, func = next(iter(console_scripts(package).values())).partition(":")
    path = ROOT / package / (module.replace(".", "/") + ".py")
    if not path.exists() and package == "operator":
        pytest.skip("tidal_operator/cli.py is being written (the `tidal` command)")
    assert re.search(rf"^def {func}\(", path.read_text(), re.M), f"{path}: no {func}()"


def test_images_run_as_the_uids_the_operator_and_chart_expect() -> None:
    from tidal_operator.api.types import OperatorConfig

    _, stages = parse()
    for target in ("engine", "operator"):
        user = stages[target].last("USER")
        assert user and re.fullmatch(r"\d+:\d+", user), f"{target}: a numeric USER, so runAsNonRoot can be checked"
        assert int(user.split(":")[0]) != 0
    # Engine Pods get runAsUser from OperatorConfig; the chart's Pods from values.yaml.
    assert int(stages["engine"].last("USER").split(":")[0]) == OperatorConfig().run_as_user
    values = yaml.safe_load((ROOT / "charts" / "tidal" / "values.yaml").read_text())
    assert int(stages["operator"].last("USER").split(":")[0]) == values["operator"]["podSecurityContext"]["runAsUser"]


def test_engine_serves_port_8000_with_a_health_check() -> None:
    _, stages = parse()
    engine = stages["engine"]
    assert "8000" in engine.all("EXPOSE")
    health = engine.last("HEALTHCHECK")
    assert health and "/health" in health and "8000" in health
    cmd = exec_form(engine.last("CMD") or "null")
    assert cmd[0] == "serve" and "0.0.0.0" in cmd


def test_operator_image_has_no_torch() -> None:
    _, stages = parse()
    deps = tomllib.loads((ROOT / "operator" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"torch\b", d)]
    for name in ("operator-build", "operator"):
        for run in stages[name].all("RUN"):
            # The only mention of torch is the build-time check that it is absent.
            assert "torch" not in run or "find_spec('torch') is not None" in run, run
    # And the engine pins torch explicitly (an open range would pull a different CUDA build).
    assert any('"torch==${TORCH_VERSION}"' in r for r in stages["engine-build"].all("RUN"))


def test_no_secrets_or_latest_tags_in_the_dockerfile() -> None:
    text = DOCKERFILE.read_text()
    assert not re.search(r"(?i)(api[_-]?key|token|password)\s*=", text)
    global_args, stages = parse()
    for stage in stages.values():
        assert ":" in stage.base and not stage.base.endswith(":latest"), stage.base
    assert fnmatch.fnmatch(global_args["PYTHON_IMAGE"], "python:3.11-slim*")
