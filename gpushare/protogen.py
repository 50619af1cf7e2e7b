"""Regenerate the Python gRPC stubs in gpushare/pb from the .proto files under proto/.

Run ``python -m gpushare.protogen`` from the repository root after editing a .proto file. The test
suite fails while the committed stubs differ from what this produces. protoc comes from grpcio-tools,
which only this needs: the ``protogen`` extra (and the ``test`` extra) installs it.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from grpc_tools import protoc
except ImportError:
    raise ImportError("gpushare.protogen needs grpcio-tools: pip install -e '.[protogen]'") from None

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Write the stubs for every proto file into ``out_dir`` (mirroring the proto/ tree)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")


def main() -> int:
    generate(ROOT)
    print(f"regenerated stubs for {len(proto_files())} proto file(s) under {ROOT / 'gpushare' / 'pb'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
