"""Package discovery for setuptools (the rest of the metadata is in pyproject.toml).

Every package under `moecc/` ships as itself and every package under `runtime/` as
`moecc_runtime` (the runtime's import name), found on disk rather than listed by hand, so
a new subpackage can never be left out of a wheel.
"""

from setuptools import find_packages, setup

RUNTIME_DIR, RUNTIME_NAME = "runtime", "moecc_runtime"

packages = find_packages(include=["moecc", "moecc.*"]) + [
    RUNTIME_NAME + name[len(RUNTIME_DIR):] for name in find_packages(include=[RUNTIME_DIR, RUNTIME_DIR + ".*"])
]

setup(packages=packages, package_dir={RUNTIME_NAME: RUNTIME_DIR})
