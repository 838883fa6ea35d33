"""The pack as the Comfy Registry and the Manager install it: pyproject.toml's registry fields, requirements.txt
holding only what the nodes import at run time, what .comfyignore keeps out of the published pack, and the publish
workflow."""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Not loaded by the nodes: the command line's demo model and training, and optional kernels (each with its message)
NOT_AT_RUN_TIME = ("carnator_engine/demo/", "carnator_engine/__main__.py", "carnator_engine/backbones/tiny_dit.py")


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _lines(name: str) -> list:
    lines = [line.split("#")[0].strip() for line in (ROOT / name).read_text().splitlines()]
    return [line for line in lines if line]


def test_pyproject_for_the_comfy_registry():
    config = _config()
    project, comfy = config["project"], config["tool"]["comfy"]
    assert project["name"] == "comfyui-carnator"
    assert project["description"]
    assert project["dependencies"] == _lines("requirements.txt")
    version = re.search(r'__version__ = "([^"]+)"', (ROOT / "carnator_engine" / "__init__.py").read_text())
    assert project["version"] == version.group(1)
    assert (comfy["PublisherId"], comfy["DisplayName"]) == ("carnator", "Carnator")
    if "readme" in project:
        assert (ROOT / project["readme"]).is_file()


def test_the_registry_page_names_the_repository_an_icon_in_it_and_the_gpu():
    config = _config()
    repository = config["project"]["urls"]["Repository"]
    owner_name = re.fullmatch(r"https://github\.com/([\w.-]+/[\w.-]+)", repository).group(1)
    icon = re.fullmatch(rf"https://raw\.githubusercontent\.com/{re.escape(owner_name)}/main/(.+)",
                        config["tool"]["comfy"]["Icon"])
    assert icon and (ROOT / icon.group(1)).is_file()
    assert "Environment :: GPU :: NVIDIA CUDA" in config["project"]["classifiers"]


def test_requires_comfyui_says_what_is_tested():
    """The lower bound is the host the host tests run on (docs/HOST-NOTES.md names it)."""
    tested = re.search(r"ComfyUI \*\*([\d.]+)\*\*", (ROOT / "docs" / "HOST-NOTES.md").read_text()).group(1)
    assert _config()["tool"]["comfy"]["requires-comfyui"].startswith(f">={tested},")


def _imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _run_time_files() -> list:
    files = [ROOT / "__init__.py", *(ROOT / "nodes").rglob("*.py"), *(ROOT / "carnator_engine").rglob("*.py")]
    return [f for f in files if not str(f.relative_to(ROOT)).startswith(NOT_AT_RUN_TIME)]


def test_requirements_hold_only_what_the_nodes_import_at_run_time():
    """One package that fails to install fails a Manager install: each requirement is imported by code the nodes
    run; the demo model's einops is an extra, Redis and the GPU kernels are extras with their own messages."""
    run_time = set().union(*map(_imports, _run_time_files()))
    for requirement in _lines("requirements.txt"):
        assert re.split(r"[<>=!~\[ ]", requirement)[0] in run_time, requirement
    assert "einops" in _imports(ROOT / "carnator_engine" / "backbones" / "tiny_dit.py")
    assert "einops" not in run_time
    assert _config()["project"]["optional-dependencies"]["demo"] == ["einops"]


def test_the_redis_extra_matches_requirements_redis():
    config = _config()
    assert config["project"]["optional-dependencies"]["redis"] == _lines("requirements-redis.txt")
    assert "-r requirements-redis.txt" in (ROOT / "requirements-dev.txt").read_text().splitlines()


def test_comfyignore_keeps_tests_benchmarks_and_results_out_of_the_pack():
    patterns = _lines(".comfyignore")
    assert {"tests/", "benchmarks/"} <= set(patterns)       # benchmarks/results/ inside
    for kept in ("__init__.py", "nodes/", "carnator_engine/", "web/", "docs/", "workflows/", "requirements.txt",
                 "pyproject.toml", "README.md"):
        assert not any(kept.startswith(pattern.rstrip("/")) for pattern in patterns), kept


def test_the_publish_workflow_follows_the_registry_action():
    workflow = (ROOT / ".github" / "workflows" / "publish.yml").read_text()
    assert "uses: Comfy-Org/publish-node-action@v1" in workflow
    assert "personal_access_token: ${{ secrets.REGISTRY_ACCESS_TOKEN }}" in workflow
    assert '"pyproject.toml"' in workflow and "workflow_dispatch" in workflow
