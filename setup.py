"""Packages: everything under batchmlx/, plus the top-level migrations/ folder shipped inside the
package as `batchmlx.migrations` (a wheel install has no repository around it to find it in)."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["batchmlx", "batchmlx.*"]), "batchmlx.migrations"],
    package_dir={"batchmlx.migrations": "migrations"},
    package_data={
        "batchmlx.migrations": ["script.py.mako", "versions/*.py"],
        "batchmlx.server": ["static/*"],  # the dashboard's page, script and styles
    },
)
