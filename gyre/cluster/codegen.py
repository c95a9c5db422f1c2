"""Regenerate the gRPC code in `gyre/cluster/proto` from `schemas/gyre.proto` (`python -m gyre.cluster.codegen`).

The generated files are checked in, so running Gyre needs only `grpcio` and `protobuf`; `grpcio-tools` (a dev
dependency) is needed to regenerate them. `tests/cluster/test_proto.py` regenerates into a temporary directory
and fails when the result differs from what is checked in.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "schemas" / "gyre.proto"
OUT = Path(__file__).resolve().parent / "proto"
FILES = ("gyre_pb2.py", "gyre_pb2.pyi", "gyre_pb2_grpc.py")


def generate(out: Path) -> dict[str, str]:
    """Run protoc on the schema into ``out``; returns the generated files' text, imports made package-relative."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out.mkdir(parents=True, exist_ok=True)
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    code = protoc.main(["grpc_tools.protoc", f"-I{PROTO.parent}", f"-I{include}", f"--python_out={out}",
                        f"--pyi_out={out}", f"--grpc_python_out={out}", str(PROTO)])
    if code != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {code})")
    texts = {}
    for name in FILES:
        text = (out / name).read_text()
        text = re.sub(r"^import gyre_pb2 as", "from gyre.cluster.proto import gyre_pb2 as", text, flags=re.M)
        texts[name] = text
    return texts


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        texts = generate(Path(tmp))
    for name, text in texts.items():
        (OUT / name).write_text(text)
    print(f"wrote {', '.join(texts)} to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
