"""pyproject.toml for the Comfy Registry agrees with requirements.txt and the engine's version."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_for_the_comfy_registry():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project, comfy = config["project"], config["tool"]["comfy"]
    assert project["name"] == "comfyui-carnator"
    assert project["description"]
    requirements = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    assert project["dependencies"] == [line for line in requirements if line]
    version = re.search(r'__version__ = "([^"]+)"', (ROOT / "carnator_engine" / "__init__.py").read_text())
    assert project["version"] == version.group(1)
    assert comfy == {"PublisherId": "carnator", "DisplayName": "Carnator", "Icon": ""}
    if "readme" in project:
        assert (ROOT / project["readme"]).is_file()


def test_the_redis_extra_matches_requirements_redis():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements-redis.txt").read_text().splitlines()]
    assert config["project"]["optional-dependencies"]["redis"] == [line for line in lines if line]
    assert "-r requirements-redis.txt" in (ROOT / "requirements-dev.txt").read_text().splitlines()
