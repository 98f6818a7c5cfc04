"""Packages: everything under batchmlx/, plus the top-level migrations/ folder shipped inside the
package as `batchmlx.migrations` and the example batch files of jobs/examples/ as
`batchmlx/examples/` (a wheel install has no repository around it to find them in)."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["batchmlx", "batchmlx.*"]),
        "batchmlx.migrations",
        "batchmlx.examples",
    ],  # fmt: skip
    package_dir={"batchmlx.migrations": "migrations", "batchmlx.examples": "jobs/examples"},
    package_data={
        "batchmlx.migrations": ["script.py.mako", "versions/*.py"],
        "batchmlx.examples": ["*.jsonl"],  # data only (batchmlx/cli/examples.py finds them)
        "batchmlx.server": ["static/*"],  # the dashboard's page, script and styles
        # the host kernels: each source, the headers they share and the library built from
        # them (engine/host/native_lib.py)
        "batchmlx.engine.host": ["native/*.c", "native/*.h", "native/libbatchmlx_*.so"],
    },
)
