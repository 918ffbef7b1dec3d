"""Package list for setuptools (metadata lives in pyproject.toml).

`profiles/` at the repository top is installed as the package `rafl.profiles` (see
``package-dir`` in pyproject.toml); find_packages cannot see it there, so it is added by name.
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["rafl", "rafl.*"]) + ["rafl.profiles"])
