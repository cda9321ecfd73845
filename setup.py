"""Package discovery for the wheel; everything else is in pyproject.toml.

engine/, kernels/ and quant/ live at the top of the repository but install as
sub-packages of pagedllm_integrations (names like `kernels` must never be top-level
modules in site-packages: transformers probes for a Hugging Face package of that name).
pyproject.toml alone can map a folder to a package but not discover the packages below a
mapped folder, and a hand-kept list went stale once (engine/distributed/ was missing from
the wheel). So every package is found here, each mapped folder's sub-packages included;
tests/test_packaging.py builds the wheel and checks that every module is in it.
"""

from setuptools import find_packages, setup

MAPPED = ("engine", "kernels", "quant")  # folder -> pagedllm_integrations.<folder>

packages = find_packages(include=["pagedllm_integrations", "pagedllm_integrations.*"])
package_dir = {}
for folder in MAPPED:
    for found in [folder, *(f"{folder}.{sub}" for sub in find_packages(folder))]:
        name = f"pagedllm_integrations.{found}"
        packages.append(name)
        package_dir[name] = found.replace(".", "/")

setup(packages=packages, package_dir=package_dir)
