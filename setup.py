"""Ship ``ampdoctor-env.pth`` into site-packages, with the wheel and with an editable install.

The file is the start-up hook of ``AMPDOCTOR=1 python train.py`` (``src/ampdoctor/runner/startup.py``): one line that
``site`` runs at every interpreter start, inert (one environment lookup) unless ``AMPDOCTOR`` is set. setuptools
has no option for a file at the top of site-packages; this is what pytest-cov and labscript do. Everything else is
in pyproject.toml.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = os.path.join("src", "ampdoctor-env.pth")


class build_py_with_pth(build_py):
    """The wheel: the .pth next to the package, at the top of site-packages."""

    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, os.path.basename(PTH)), preserve_mode=0)


class editable_wheel_with_pth(editable_wheel):
    """``pip install -e``: the editable wheel holds the .pth too (its build folder is not installed)."""

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copy(PTH, os.path.join(unpacked_wheel, os.path.basename(PTH)))
        return result


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})
