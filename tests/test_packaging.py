"""What a user gets from `pip install pagedllm`: every module in the wheel, the prebuilt C++
kernels and the default model, a license, one version, metadata, and a clear line instead of
a traceback when an extra is missing. (tests/test_first_use.py installs the wheel into a
fresh virtual environment and runs it; slow.)"""

from __future__ import annotations

import email
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package it installs as.
MAPPED = {"pagedllm_integrations": "pagedllm_integrations"} | {
    name: f"pagedllm_integrations/{name}" for name in ("engine", "kernels", "quant")
}


_NOT_SOURCE = (".git", ".venv", "build", "dist", "site", "*.egg-info", "__pycache__",
               ".*_cache", ".hypothesis", "benchmarks", "examples", "tests", "docs")  # fmt: skip


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel built from a copy of this checkout (the build leaves its build/ folder in
    the copy), offline: no build isolation, so no package index is needed."""
    source = tmp_path_factory.mktemp("source") / "pagedllm"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = out.glob("pagedllm-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_carries_the_kernels_prebuilt_for_each_instruction_set(wheel):
    """No compiler needed: one library per x86 level, and the torch release they are bound
    to, in a platform wheel that serves every Python version (they are not extensions)."""
    import torch

    from pagedllm_integrations.kernels import isa_levels

    names = set(wheel.namelist())
    prebuilt = "pagedllm_integrations/kernels/prebuilt"
    manifest = json.loads(wheel.read(f"{prebuilt}/manifest.json"))
    assert manifest["torch"] == torch.__version__.split("+")[0]
    assert manifest["sources"] == isa_levels.sources_digest()
    assert sorted(manifest["levels"]) == ["amx", "avx2", "avx512"]
    for level in isa_levels.LEVELS:
        entry = manifest["levels"][level.name]
        assert entry["cflags"] == list(level.cflags)
        library = wheel.getinfo(f"{prebuilt}/{entry['library']}")
        assert library.file_size > 100_000
        assert wheel.read(library)[:4] == b"\x7fELF"
    (wheel_meta,) = [n for n in names if n.endswith(".dist-info/WHEEL")]
    meta = email.message_from_bytes(wheel.read(wheel_meta))
    assert meta["Root-Is-Purelib"] == "false"
    assert meta["Tag"].startswith("py3-none-") and "x86_64" in meta["Tag"]


def test_the_wheel_carries_the_default_model_converted(wheel):
    """`pip install pagedllm` alone: the GGUF file, and its config and tokenizer already
    read from it, so the first LLM() converts nothing."""
    from pagedllm_integrations.engine.model_loader import default_model_path

    embedded = "pagedllm_integrations/engine/embedded_model"
    gguf = wheel.getinfo(f"{embedded}/{default_model_path().name}")
    assert gguf.file_size == default_model_path().stat().st_size
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert f"{embedded}/hf/{name}" in wheel.namelist()
    assert "Apache-2.0" in wheel.read(f"{embedded}/SOURCE.txt").decode()  # where it came from
    marker = json.loads(wheel.read(f"{embedded}/hf/gguf.json"))
    assert marker == {"file": f"../{default_model_path().name}"}


def test_the_wheel_holds_every_module_of_the_source_tree(wheel):
    names = set(wheel.namelist())
    expected = {
        f"{package}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, package in MAPPED.items()
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert expected, "no source found"
    missing = sorted(expected - names)
    assert not missing, f"modules missing from the wheel: {missing}"
    # The packages added since the list was kept by hand, named: tensor parallelism and
    # Ray replicas, and the chat layer.
    assert "pagedllm_integrations/engine/distributed/ray_replicas.py" in names
    assert "pagedllm_integrations/chat/prepare.py" in names
    # Nothing lands at the top level of site-packages but our one import root.
    roots = {name.split("/")[0] for name in names if not name.endswith(".dist-info/")}
    assert {r for r in roots if not r.endswith(".dist-info")} == {"pagedllm_integrations"}
    assert any(n.startswith("pagedllm_integrations/quant/data/") for n in names)
    # the C++ sources of the CPU kernels, compiled on the user's machine at first use
    for source in ("ops.cpp", "linear_bf16.cpp", "linear_packed.cpp", "attention.cpp", "common.h"):
        assert f"pagedllm_integrations/kernels/csrc/{source}" in names
    assert "pagedllm_integrations/py.typed" in names


def test_the_wheel_has_license_version_and_classifiers(wheel):
    import pagedllm_integrations

    (meta_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(wheel.read(meta_name))
    assert meta["Version"] == pagedllm_integrations.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel.namelist())
    classifiers = meta.get_all("Classifier")
    assert "Programming Language :: Python :: 3.11" in classifiers
    # No Project-URL yet: the project has no public repository to point at.


def test_one_version_string():
    """pyproject.toml reads the version from the package; nothing else spells it."""
    import pagedllm_integrations

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert not re.search(r'^version = "', pyproject, re.M)
    assert 'attr = "pagedllm_integrations.__version__"' in pyproject
    assert (ROOT / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]
    spelled = [
        path
        for folder in MAPPED
        for path in (ROOT / folder).rglob("*.py")
        if pagedllm_integrations.__version__ in path.read_text()
    ]
    assert spelled == [ROOT / "pagedllm_integrations" / "__init__.py"]


# Runs the CLI with the server extra's modules made unimportable, as without the extra.
_WITHOUT_SERVER_EXTRA = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastapi", "uvicorn", "starlette", "prometheus_client"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
from pagedllm_integrations.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", [["serve"], ["serve", "--model", "x.gguf", "--port", "9"]])
def test_serve_without_the_server_extra_says_which_extra_in_one_line(command):
    done = subprocess.run(
        [sys.executable, "-P", "-c", _WITHOUT_SERVER_EXTRA, *command],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "pagedllm[server]" in lines[0] and "serve" in lines[0]
