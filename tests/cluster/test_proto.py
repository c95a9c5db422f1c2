"""The checked-in gRPC code is what `schemas/gyre.proto` generates."""

from pathlib import Path

from gyre.cluster import codegen


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    texts = codegen.generate(tmp_path)
    for name, text in texts.items():
        checked_in = (codegen.OUT / name).read_text()
        assert checked_in == text, (f"gyre/cluster/proto/{name} is stale: run `python -m gyre.cluster.codegen` "
                                    f"after changing schemas/gyre.proto")


def test_services_are_importable() -> None:
    from gyre.cluster.proto import gyre_pb2, gyre_pb2_grpc

    assert {s for s in gyre_pb2.DESCRIPTOR.services_by_name} == {"Cell", "Proxy", "Admin", "Log", "Trainer"}
    assert hasattr(gyre_pb2_grpc, "CellServicer")
