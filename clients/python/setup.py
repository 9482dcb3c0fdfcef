"""Builds the tts.v1 stubs into the package: protoc (grpcio-tools) over the repository's proto.

The proto is taken from `protos/` of the repository (two folders up) or, in an sdist, from the copy
that `sdist` puts next to this file.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PROTO = Path("tts") / "v1" / "tts.proto"
PACKAGE = "qwen3_tts_client"


def _proto_source() -> Path:
    for root in (HERE.parent.parent / "protos", HERE / "protos"):
        if (root / PROTO).exists():
            return root / PROTO
    raise FileNotFoundError(f"{PROTO} not found in the repository's protos/ or next to setup.py")


def _generate(out_dir: Path) -> None:
    """Compile the proto as `<PACKAGE>/_proto/tts.proto`, so the stubs import as a subpackage."""
    import grpc_tools
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / PACKAGE / "_proto"
        target.mkdir(parents=True)
        shutil.copy(_proto_source(), target / "tts.proto")
        well_known = Path(grpc_tools.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{tmp}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(Path(PACKAGE) / "_proto" / "tts.proto"),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on tts.proto")
    (out_dir / PACKAGE / "_proto" / "__init__.py").touch()


class BuildWithStubs(build_py):
    def run(self) -> None:
        super().run()
        _generate(Path(self.build_lib))


class SdistWithProto(sdist):
    def make_release_tree(self, base_dir, files) -> None:
        super().make_release_tree(base_dir, files)
        dest = Path(base_dir) / "protos" / PROTO
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_proto_source(), dest)


setup(cmdclass={"build_py": BuildWithStubs, "sdist": SdistWithProto})
