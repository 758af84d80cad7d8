"""Ships conf/, recipes/ and fpga_kernels/ inside the wheel as lightning_smartinf/_assets/.

A source checkout reads them from the repository root; an installed wheel reads the copies
(see lightning_smartinf/resources.py).
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ASSET_DIRS = ("conf", "recipes", "fpga_kernels")


class BuildWithAssets(build_py):
    def run(self) -> None:
        super().run()
        root = Path(__file__).parent
        for name in ASSET_DIRS:
            if not (root / name).is_dir():
                continue
            target = Path(self.build_lib) / "lightning_smartinf" / "_assets" / name
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(root / name, target)


setup(cmdclass={"build_py": BuildWithAssets})
