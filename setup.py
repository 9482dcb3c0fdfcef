"""Build hook of the wheel (everything else is in pyproject.toml): the wheel carries the gRPC stubs
generated from protos/ at build time, and copies of protos/ and configs/ as package data under
qtts/_data/ (qtts/resources.py finds them there when the package is installed)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _protogen():
    spec = importlib.util.spec_from_file_location("_qtts_protogen", HERE / "qtts" / "protogen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithStubs(build_py):
    """build_py, then the package data only a build produces: stubs, protos and configs."""

    def run(self) -> None:
        super().run()
        package = Path(self.build_lib) / "qtts"
        data = package / "_data"
        for name in ("protos", "configs"):
            shutil.rmtree(data / name, ignore_errors=True)
            shutil.copytree(HERE / name, data / name, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.rmtree(package / "_gen", ignore_errors=True)
        _protogen().generate(data / "protos", package / "_gen")


setup(cmdclass={"build_py": BuildWithStubs})
