"""Which packages the wheel holds; everything else about the project is in pyproject.toml.

Why a setup.py: Hydra's configs stay at the top of the repo (``configs/``, where the CLI, the
scripts and the tests read them), and a wheel must carry them too, or ``stabilize-train``
from a ``pip install .`` fails with "Primary config directory not found". So ``configs/`` is
mapped to the data-only package ``stabilize.configs`` (``stabilize/configs/`` once
installed), which ``stabilize.paths.config_dir`` finds. pyproject.toml's package
discovery cannot add a package that lives outside its directory tree; ``find_namespace_packages``
here is what its ``[tool.setuptools.packages.find] include = ["stabilize*"]`` did. The fused
CPU kernel's C++ source (``stabilize/csrc/``) is package data too: it is built where it is
installed (``stabilize/cpu_kernels.py``).
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["stabilize*"]), "stabilize.configs"],
    package_dir={"stabilize.configs": "configs"},
    package_data={
        "stabilize.configs": ["*.yaml", "**/*.yaml"],
        "stabilize.csrc": ["*.cpp"],
        "stabilize": ["py.typed"],
    },  # fmt: skip
)
