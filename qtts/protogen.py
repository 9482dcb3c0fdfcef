"""Generate the protobuf/gRPC stubs of a folder of .proto files (grpcio-tools' protoc).

Imports nothing of the package, so that setup.py can load this file on its own and build the stubs
into the wheel; `qtts.pb` uses it to (re)build them in a checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

STAMP = ".stamp"


def proto_files(proto_dir: Path) -> list[Path]:
    return sorted(proto_dir.rglob("*.proto"))


def generate(proto_dir: Path, gen_dir: Path) -> None:
    """protoc over every .proto under `proto_dir` into `gen_dir` (python, pyi, grpc), with an
    `__init__.py` in every package folder and a stamp file written last."""
    import grpc_tools
    from grpc_tools import protoc

    gen_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(Path(grpc_tools.__file__).parent / "_proto")
    files = [str(p.relative_to(proto_dir)) for p in proto_files(proto_dir)]
    if not files:
        raise RuntimeError(f"no .proto files under {proto_dir}")
    args = [
        "protoc",
        f"-I{proto_dir}",
        f"-I{well_known}",
        f"--python_out={gen_dir}",
        f"--pyi_out={gen_dir}",
        f"--grpc_python_out={gen_dir}",
        *files,
    ]
    tmp_stamp = gen_dir / f"{STAMP}.{os.getpid()}"
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {files}")
    for sub in {Path(f).parts[0] for f in files}:
        for d in [gen_dir / sub, *[p for p in (gen_dir / sub).rglob("*") if p.is_dir()]]:
            (d / "__init__.py").touch()
    tmp_stamp.touch()
    tmp_stamp.replace(gen_dir / STAMP)
