"""Packaging for ampinit.

Dependencies are declared here (not only in pyproject.toml) because the CI script and the README install
with ``pip install -e .[test]`` and the issue that founded the project asks for a setup.py.  torch is a
lower bound only, the oldest release the suite runs under (README.md, "Install"): CI installs ``torch==2.13.0``
(the CPU wheel) *before* this package, so pip never has to pick a torch build itself.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

_HERE = Path(__file__).parent
_VERSION = re.search(r'^__version__ = "([^"]+)"', (_HERE / "ampinit" / "_version.py").read_text(), re.MULTILINE).group(
    1
)  # type: ignore[union-attr]

setup(
    name="ampinit",
    version=_VERSION,
    description="Automatic mixed precision for PyTorch with the NVIDIA Apex amp API (O0-O5), no compilation needed",
    long_description=(_HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    author="the ampinit authors",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    # No url or project_urls: the project has no public home page yet (nothing is invented here). The docs
    # travel with the source: README.md (the long description above) links docs/*.md.
    keywords=["pytorch", "mixed precision", "amp", "apex", "fp16", "bf16", "loss scaling", "master weights"],
    python_requires=">=3.10",  # torch >= 2.11 needs it; ruff and mypy target the same
    packages=find_packages(include=["ampinit", "ampinit.*"]),
    package_data={"ampinit": ["py.typed"]},
    # numpy: without it every `import torch` prints "Failed to initialize NumPy" (and pytest, which turns
    # warnings into errors, fails), so the minimal install must bring it.
    install_requires=["torch>=2.11", "packaging", "numpy"],
    extras_require={
        # `ampinit migrate` rewrites source with libcst; nothing else needs it.
        "migrate": ["libcst>=1.1"],
        # numpy: torch warns at import without it, and pytest turns warnings into errors.
        # triton: the master-step kernels are tested on CPU through its interpreter. It requires no torch (so it
        # never swaps the pinned wheel) and installs in about a minute; wheels exist for Linux only.
        # pytest-xdist and pytest-timeout: `pytest -n N --dist loadfile --timeout S`, as scripts/gpu_check.sh runs
        # the suite (the timeout counts a module fixture in the first test that needs it: see its timeout marks).
        "test": [
            "pytest>=7",
            "pytest-xdist>=3",
            "pytest-timeout>=2",
            "hypothesis>=6",
            "libcst>=1.1",
            "numpy",
            'triton; sys_platform == "linux" and (platform_machine == "x86_64" or platform_machine == "aarch64")',
        ],
        "dev": ["mypy>=1.8", "ruff>=0.4"],
        # `ampinit demo` draws its PNG with matplotlib and shows progress with tqdm; it runs without both.
        "demo": ["matplotlib", "tqdm"],
    },
    entry_points={"console_scripts": ["ampinit=ampinit.cli:main"]},
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Environment :: Console",
        "Environment :: GPU :: NVIDIA CUDA",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: Software Development :: Libraries :: Python Modules",
        "Typing :: Typed",
    ],
)
