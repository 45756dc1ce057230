"""The GPU machine's image, as far as imports go: `bench/gpu_suite.py --dry-run` puts this folder
first on the PYTHONPATH of the commands it spawns (the GPU tests' collection), with
SPECDEC_DEVICE_IMAGE_LACKS naming the top-level packages that image lacks, so that a module that
needs one fails to import here as it would there, instead of costing the GPU run its tests."""

import os
import sys

LACKS = frozenset(filter(None, os.environ.get("SPECDEC_DEVICE_IMAGE_LACKS", "").split(",")))


class _Lacking:
    """A meta-path finder that refuses the packages in `LACKS` (and their submodules)."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in LACKS:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the GPU image)", name=name)
        return None


if LACKS:
    sys.meta_path.insert(0, _Lacking())
