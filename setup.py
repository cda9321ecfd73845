"""Package discovery and the wheel's prebuilt parts; everything else is in pyproject.toml.

engine/, kernels/ and quant/ live at the top of the repository but install as
sub-packages of pagedllm_integrations (names like `kernels` must never be top-level
modules in site-packages: transformers probes for a Hugging Face package of that name).
pyproject.toml alone can map a folder to a package but not discover the packages below a
mapped folder, and a hand-kept list went stale once (engine/distributed/ was missing from
the wheel). So every package is found here, each mapped folder's sub-packages included,
and so are the data folders (kernels/csrc, quant/data), which setuptools otherwise warns
about at length; tests/test_packaging.py builds the wheel and checks what is in it.

A wheel (not an editable install) built where torch and transformers can be imported, as
`make wheel` does (`pip wheel --no-build-isolation`), also carries:
- the C++ kernels compiled for each x86 instruction-set level (kernels/isa_levels.py), with
  a manifest of the torch release they are bound to; the wheel is then tagged
  py3-none-<platform> (the libraries are not Python extensions: one wheel serves every
  Python version);
- the default model (engine/default_model.py): its GGUF file and converted folder.
Both are built by the package itself, run from the build folder. PAGEDLLM_WHEEL_EXTRAS=0
leaves them out (a wheel that compiles on first use, as a source install does); =1 makes
their absence an error instead of a warning.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

MAPPED = ("engine", "kernels", "quant")  # folder -> pagedllm_integrations.<folder>
DATA_FOLDERS = ("kernels/csrc", "quant/data")  # installed as they are, no __init__.py

packages = find_packages(include=["pagedllm_integrations", "pagedllm_integrations.*"])
package_dir = {}
for folder in MAPPED:
    for found in [folder, *(f"{folder}.{sub}" for sub in find_packages(folder))]:
        name = f"pagedllm_integrations.{found}"
        packages.append(name)
        package_dir[name] = found.replace(".", "/")
for folder in DATA_FOLDERS:
    name = "pagedllm_integrations." + folder.replace("/", ".")
    packages.append(name)
    package_dir[name] = folder


def _extras_wanted() -> bool:
    setting = os.environ.get("PAGEDLLM_WHEEL_EXTRAS", "auto")
    if setting == "0":
        return False
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if platform.machine() not in ("x86_64", "AMD64"):
        missing.append("an x86-64 machine (the levels are x86's)")
    if missing and setting == "1":
        raise SystemExit(
            f"PAGEDLLM_WHEEL_EXTRAS=1 needs {missing} in the build environment: build with "
            "`pip wheel --no-build-isolation` (or `make wheel`)"
        )
    if missing:
        print(
            f"pagedllm: building without {missing}, so this wheel carries no "
            "prebuilt kernels and no default model (build with `make wheel` for those)",
            file=sys.stderr,
        )
    return not missing


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode or not self.distribution.has_ext_modules():
            return
        root = Path(self.build_lib) / "pagedllm_integrations"
        _run_from(
            self.build_lib, "kernels.isa_levels", "build_levels", root / "kernels" / "prebuilt"
        )
        _run_from(self.build_lib, "engine.default_model", "embed_into", root)


def _run_from(build_lib: str, module: str, function: str, folder: Path) -> None:
    """Run a function of the package as built (so the wheel's parts come from its own code)."""
    code = f"from pagedllm_integrations.{module} import {function}; {function}({str(folder)!r})"
    env = {**os.environ, "PYTHONPATH": build_lib}
    subprocess.run([sys.executable, "-P", "-c", code], env=env, check=True)


class WheelWithKernels(bdist_wheel):
    def finalize_options(self) -> None:
        if _extras_wanted():
            # Binaries inside: a platform wheel, installed as platlib.
            self.distribution.has_ext_modules = lambda: True  # type: ignore[method-assign]
        super().finalize_options()

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        if not self.root_is_pure:  # the libraries are loaded by torch, not imported by Python
            return "py3", "none", plat
        return python, abi, plat


setup(
    packages=packages,
    package_dir=package_dir,
    cmdclass={"build_py": BuildPy, "bdist_wheel": WheelWithKernels},
)
