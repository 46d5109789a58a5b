"""The one build step pyproject.toml cannot declare: the Hydra groups in the top-level `configs/`
go into a built package as data of `jaxstream`, at `jaxstream/configs/`, where `jaxstream.config`
looks before it looks beside the package (the checkout's `configs/`, for a source tree or an editable
install). Inside `jaxstream` rather than a top-level `configs` package: an installed name that
generic could be shadowed by, or overwrite, any other `configs` on the path.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONFIGS = Path("configs")  # setuptools runs this file from the project root


class BuildPyWithConfigs(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads the checkout's configs/ in place
            return
        for source in sorted(CONFIGS.rglob("*.yaml")):
            target = Path(self.build_lib, "jaxstream", source)
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target))


setup(cmdclass={"build_py": BuildPyWithConfigs})
