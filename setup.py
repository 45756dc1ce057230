"""Package mapping: the top-level `kernels/` folder installs as `specdec_fast.kernels`.

It is never installed as a top-level `kernels` package, which would shadow the Hugging Face
`kernels` library that transformers imports. Metadata lives in pyproject.toml.
"""

from setuptools import find_packages, setup

# specdec_fast/data holds only the shipped prompt files: a data package, declared as one so that
# setuptools installs it without warning of an importable folder missing from `packages`.
engine_packages = find_packages(include=["specdec_fast", "specdec_fast.*"]) + ["specdec_fast.data"]
kernel_packages = ["specdec_fast.kernels"] + [
    "specdec_fast.kernels." + name for name in find_packages(where="kernels")
]

setup(
    packages=engine_packages + kernel_packages,
    package_dir={"specdec_fast.kernels": "kernels"},
    include_package_data=True,
    package_data={
        "specdec_fast": ["bundled/*/*"],
        "specdec_fast.data": ["*.jsonl"],
        "specdec_fast.kernels": ["configs.json"],
    },
)
