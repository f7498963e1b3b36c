"""The container recipe, checked offline: the Dockerfile parses, installs only through the one
constraints file, and the pins agree with pyproject.toml. (That every pin exists and that they
resolve together needs the index: `python tools/check_constraints.py --resolve`, recorded in
containers/README.md.)"""

import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.repo_tools import load_tool

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
CONSTRAINTS_IN_IMAGE = "containers/constraints-gpu.txt"
INSTRUCTIONS = {
    "FROM",
    "RUN",
    "CMD",
    "LABEL",
    "EXPOSE",
    "ENV",
    "ADD",
    "COPY",
    "ENTRYPOINT",
    "VOLUME",
    "USER",
    "WORKDIR",
    "ARG",
    "ONBUILD",
    "STOPSIGNAL",
    "HEALTHCHECK",
    "SHELL",
}


TOOL = load_tool("check_constraints")


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) with line continuations joined and comments dropped."""
    result, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).strip().partition(" ")
        result.append((keyword, arguments.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return result


def pip_installs(parsed) -> list[list[str]]:
    """The words of every `pip install` command in RUN instructions."""
    commands = []
    for keyword, arguments in parsed:
        if keyword == "RUN":
            for command in re.split(r"&&|;", arguments):
                words = shlex.split(command)
                if words[:2] == ["pip", "install"]:
                    commands.append(words[2:])
    return commands


def named_packages(words: list[str]) -> list[str]:
    """Package names a pip install command asks for (options, their values and local paths dropped)."""
    names, skip_next = [], False
    for word in words:
        if skip_next or word.startswith("-"):
            skip_next = word in ("-c", "-e", "-r", "--constraint")
            continue
        if not word.startswith("."):
            names.append(canonicalize_name(Requirement(word).name))
    return names


@pytest.fixture(scope="module")
def parsed():
    return instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def pins():
    return TOOL.parse_constraints()


def test_dockerfile_parses_with_known_instructions_from_first(parsed):
    assert parsed and all(keyword in INSTRUCTIONS for keyword, _ in parsed), [k for k, _ in parsed]
    keyword, image = parsed[0]
    assert keyword == "FROM"
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-cudnn-devel-ubuntu24\.04", image)  # CUDA 13 for torch 2.13
    assert any(keyword == "RUN" and "python3.12 -m venv" in arguments for keyword, arguments in parsed)


def test_constraints_file_is_copied_before_any_install_and_used_by_every_one(parsed):
    copies = [i for i, (k, a) in enumerate(parsed) if k == "COPY" and a.split() == [CONSTRAINTS_IN_IMAGE] * 2]
    first_pip = next(i for i, (k, a) in enumerate(parsed) if k == "RUN" and "pip install" in a)
    assert copies and copies[0] < first_pip
    commands = pip_installs(parsed)
    assert len(commands) >= 5
    for words in commands:
        assert ["-c", CONSTRAINTS_IN_IMAGE] == words[words.index("-c") : words.index("-c") + 2], words
        versioned = [word for word in words if re.search(r"[=<>~]=|[<>]", word)]
        assert not versioned, f"a version outside the constraints file: {versioned}"


def test_every_package_the_dockerfile_names_is_pinned(parsed, pins):
    named = {name for words in pip_installs(parsed) for name in named_packages(words)}
    stack = {"torch", "vllm", "megatron-core", "transformer-engine", "transformer-engine-cu13"}
    assert stack <= named
    assert sorted(named - set(pins)) == []
    for name in TOOL.NOT_RESOLVED:  # the special installs the dry run leaves out are pinned too
        assert name in pins


def test_special_installs_match_the_tool(parsed):
    """The tool's dry run leaves out exactly what the Dockerfile installs without the resolver."""
    commands = pip_installs(parsed)
    no_deps = {name for words in commands if "--no-deps" in words for name in named_packages(words)}
    source_built = [words for words in commands if "--no-build-isolation" in words]
    assert no_deps == set()
    assert any("transformer-engine[core_cu13,pytorch]" in words for words in source_built)
    assert set(TOOL.NOT_RESOLVED) == {"transformer-engine-torch"}
    project_install = next(words for words in commands if "-e" in words)
    extras = re.search(r"\[(.*)\]", project_install[project_install.index("-e") + 1]).group(1).split(",")
    assert tuple(extras) == TOOL.CONTAINER_EXTRAS


def test_pins_cover_the_stack_at_the_required_versions(pins):
    assert Version(pins["megatron-core"]) >= Version("0.19")
    for name in ("torch", "vllm", "transformer-engine", "ray", "nemo-run"):
        assert name in pins


def test_the_gpu_image_ships_the_versions_the_tests_ran_or_names_why_not(pins):
    """Every package both the GPU image and tools/cpu-lock.txt install has one version, except
    those tools/check_constraints.py names with a reason (each of which does differ, and is in
    containers/README.md); nothing installs megatron-bridge, which no code imports."""
    lock = TOOL.parse_constraints(TOOL.CPU_LOCK)
    differences = TOOL.lock_differences(pins, lock)
    assert set(differences) == set(TOOL.DIFFERENT_ON_PURPOSE), differences
    readme = (ROOT / "containers" / "README.md").read_text()
    assert all(f"| {name} |" in readme for name in TOOL.DIFFERENT_ON_PURPOSE)
    assert {"torch", "vllm", "transformers", "ray", "omegaconf"} <= {
        name for name in pins if TOOL.CPU_NAMES.get(name, name) in lock
    }
    assert TOOL.lock_differences({"vllm": "0.31.0", "torch": "2.13.0"}, lock) == {"vllm": ("0.31.0", "0.32.0")}
    assert "megatron-bridge" not in pins and "megatron-bridge" not in lock


def incompatible(pins: dict[str, str], requirements) -> list[str]:
    return [
        f"{req} vs =={pins[canonicalize_name(req.name)]}"
        for req in requirements
        if canonicalize_name(req.name) in pins
        and not req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True)
    ]


def test_pins_agree_with_pyproject_on_python_312(pins):
    import tomllib

    extras = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    requirements = TOOL.project_requirements(extras)
    assert {"torch", "megatron-core", "nemo-run", "leptonai", "matplotlib"} <= {r.name for r in requirements}
    assert incompatible(pins, requirements) == []


def test_incompatibility_is_detected():
    requirements = [Requirement("torch==2.13.0"), Requirement("megatron-core>=0.19"), Requirement("ray")]
    assert incompatible({"torch": "2.14.0", "megatron-core": "0.19.2", "ray": "2.60.0"}, requirements) == [
        "torch==2.13.0 vs ==2.14.0"
    ]


def test_markers_are_evaluated_for_the_container_python():
    cpu = {str(r) for r in TOOL.project_requirements(("launch",), python_version="3.11")}
    gpu = {str(r) for r in TOOL.project_requirements(("launch",), python_version="3.12")}
    assert any("leptonai==0.27.3" in r for r in cpu) and not any("leptonai==0.27.3" in r for r in gpu)


def test_constraints_parser_rejects_loose_or_repeated_pins(tmp_path):
    (tmp_path / "c.txt").write_text("torch>=2.13\n")
    with pytest.raises(ValueError, match="not name==version"):
        TOOL.parse_constraints(tmp_path / "c.txt")
    (tmp_path / "c.txt").write_text("Torch==2.13.0\ntorch==2.13.0  # again\n")
    with pytest.raises(ValueError, match="pinned twice"):
        TOOL.parse_constraints(tmp_path / "c.txt")


def test_apptainer_and_enroot_recipes_use_the_docker_image():
    definition = (ROOT / "containers" / "nemo-dapo.def").read_text()
    assert re.search(r"^Bootstrap: docker-daemon$", definition, re.M)
    assert re.search(r"^From: nemo-dapo:latest$", definition, re.M)
    assert "docker build -t nemo-dapo:latest ." in DOCKERFILE.read_text()
    readme = (ROOT / "containers" / "README.md").read_text()
    for needle in (
        "enroot import",
        "dockerd://nemo-dapo:latest",
        ".sqsh",
        "apptainer build",
        "constraints-gpu.txt",
        "resolve: ok",
    ):
        assert needle in readme, needle


def test_image_settings_for_a_cluster(parsed):
    """The adapters for NCCL under enroot, TransformerEngine built for Hopper, and no preset folder
    baked in (a mounted checkout's conf/ wins) in either GPU recipe."""
    env = " ".join(arguments for keyword, arguments in parsed if keyword == "ENV")
    assert "MELLANOX_VISIBLE_DEVICES=all" in env and "NVTE_CUDA_ARCHS=90" in env
    for recipe in (DOCKERFILE, ROOT / "containers" / "nemo-dapo.def", ROOT / "containers" / "Containerfile.cpu"):
        lines = [line for line in recipe.read_text().splitlines() if not line.lstrip().startswith("#")]
        assert not any("NEMO_DAPO_CONF_DIR" in line for line in lines), recipe


def test_build_context_leaves_out_local_environments_and_runs():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "outputs", ".git"} <= set(ignored)
