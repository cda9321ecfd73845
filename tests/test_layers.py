"""The import contracts of .importlinter (docs/architecture.md, "Layers and allowed imports"):
they hold over the package as it installs, and they fail when a forbidden import is added."""

from __future__ import annotations

import ast
import configparser
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _lint_package():
    spec = importlib.util.spec_from_file_location("lint_package", ROOT / "tools/lint_package.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lint = _lint_package()


@pytest.fixture
def tree(tmp_path):
    """A fresh copy of the package laid out as installed."""
    lint.stage(tmp_path)
    return tmp_path


def test_the_contracts_hold_over_the_package(tree):
    result = lint.run_contracts(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, source, broken",
    [
        # A kernel reaching up into the engine.
        (
            "kernels/_probe_upward.py",
            "from ..engine import config\n",
            "pagedllm_integrations.kernels._probe_upward -> pagedllm_integrations.engine.config",
        ),
        # A weight format reaching up into the models.
        (
            "quant/_probe_upward.py",
            "from ..engine.models import layers\n",
            "pagedllm_integrations.quant._probe_upward -> "
            "pagedllm_integrations.engine.models.layers",
        ),
        # The engine step reaching up into the chat layer.
        (
            "engine/scheduler_output.py",
            "from ..chat import tool_calls\n",
            "pagedllm_integrations.engine.scheduler_output -> "
            "pagedllm_integrations.chat.tool_calls",
        ),
        # A front end reaching past the EngineClient boundary into the engine's live state.
        (
            "server/_probe_request.py",
            "from ..engine.request import Request\n",
            "pagedllm_integrations.server._probe_request -> pagedllm_integrations.engine.request",
        ),
        # A model importing a weight format (the backend's factories bring those in).
        (
            "engine/models/_probe_format.py",
            "from ...quant import packed\n",
            "pagedllm_integrations.engine.models._probe_format -> pagedllm_integrations.quant",
        ),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tree, module, source, broken):
    path = tree / "pagedllm_integrations" / module
    path.write_text((path.read_text() if path.exists() else "") + source)
    result = lint.run_contracts(tree)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    # import-linter wraps long lines; compare the text without its line breaks.
    assert broken in " ".join(result.stdout.split())


def test_every_module_is_in_a_layer(tree):
    """A new module outside every layer would be outside the contract: each must be listed
    (or sit inside a listed package)."""
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    layered = {
        name.strip()
        for line in config["importlinter:contract:layers"]["layers"].splitlines()
        for name in line.split(":")
        if name.strip()
    }
    package = tree / "pagedllm_integrations"
    unlisted = []
    for path in sorted(package.rglob("*.py")):
        parts = ("pagedllm_integrations", *path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) == 1:
            continue  # the package itself: its __init__ gathers the public names
        prefixes = {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
        if prefixes & layered:
            continue
        # A folder split over layers (engine/, engine/distributed/) is in none itself: its
        # __init__ must then import nothing.
        tree_of = ast.parse(path.read_text())
        if path.name == "__init__.py" and not any(
            isinstance(node, ast.Import | ast.ImportFrom) for node in ast.walk(tree_of)
        ):
            continue
        unlisted.append(".".join(parts))
    assert not unlisted, f"modules in no layer of .importlinter: {unlisted}"


def test_tests_and_benchmarks_reach_the_engine_core_through_core_of_only():
    """White-box code reaches past the EngineClient boundary in one documented way,
    `engine/white_box.py`'s `core_of`, never by walking attributes (`llm.engine.engine`),
    and no front end reaches past it at all."""
    import re

    walking = re.compile(r"\bengine\.engine\b")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("tests", "benchmarks")
        for path in sorted((ROOT / folder).glob("*.py"))
        if path.name != "test_layers.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if walking.search(line)
    ]
    assert offenders == []
    front_ends = sorted((ROOT / "pagedllm_integrations").rglob("*.py"))
    assert [str(p) for p in front_ends if "white_box" in p.read_text()] == []
