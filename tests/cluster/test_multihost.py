"""Multi-host addressing, the log served to other hosts, and gRPC over TLS (one process, real gRPC)."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import grpc
import pytest

from gyre.cluster.address import NodeAddress, resolve
from gyre.cluster.config import ClusterConfig, ClusterSection
from gyre.cluster.log_client import RemoteLog
from gyre.cluster.tls import TlsSection
from gyre.errors import ConfigError
from gyre.events.models import CellLost


def test_a_concrete_bind_is_advertised_as_it_is() -> None:
    assert resolve("10.1.2.3") == NodeAddress("10.1.2.3", "10.1.2.3")
    assert resolve("0.0.0.0", "node7.example") == NodeAddress("0.0.0.0", "node7.example")
    assert NodeAddress("::", "fd00::2").endpoint(50) == "[fd00::2]:50"


def test_a_wildcard_bind_advertises_the_route_toward_the_controller() -> None:
    assert resolve("0.0.0.0", controller="127.0.0.1:4000").advertise == "127.0.0.1"


def test_a_wildcard_controller_must_be_told_its_address() -> None:
    with pytest.raises(ConfigError, match=r"cluster\.advertise"):
        resolve("0.0.0.0")
    with pytest.raises(ConfigError, match="wildcard"):
        resolve("10.0.0.1", "0.0.0.0")


@pytest.mark.parametrize(("cluster", "named"), [({"advertise": "0.0.0.0"}, "cluster.advertise"),
                                                 ({"launcher": "manual"}, "cluster.port"),
                                                 ({"launcher": "slurm"}, "launcher")])
def test_bad_addressing_is_refused_naming_the_key(cluster: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ClusterConfig(cluster=ClusterSection(**cluster))


def _record(cluster, n: int, tag: str) -> None:
    link = cluster.links[0] if cluster.links else cluster.link("c0")
    producer = link.producer("c0")
    link.sink.commit(producer.record([CellLost(cell_id="c0", reason=f"{tag}{i}") for i in range(n)]))


def test_the_log_is_read_and_followed_through_the_controller(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(log_path=tmp_path / "log")
    _record(cluster, 3, "a")
    log = RemoteLog(cluster.address, secret=cluster.secret)
    try:
        read = [r for b in log.read(0) for r in b.to_pylist()]
        assert [r["seq"] for r in read] == [0, 1, 2]
        assert [r["cell_lost"]["reason"] for r in read] == ["a0", "a1", "a2"]
        assert [r["seq"] for b in log.read(1, 1) for r in b.to_pylist()] == [1]
        stop = threading.Event()
        followed = log.follow(2, stop=stop)
        assert next(followed).column("seq").to_pylist() == [2]
        _record(cluster, 2, "b")  # written after the follow began: it arrives on the same stream
        assert next(followed).column("seq").to_pylist() == [3, 4]
        stop.set()
        assert list(followed) == []
    finally:
        log.close()
    stranger = RemoteLog(cluster.address, secret="gyre-run-" + "0" * 43)
    with pytest.raises(grpc.RpcError) as refused:
        list(stranger.read(0))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stranger.close()


@pytest.fixture
def tls(tmp_path: Path) -> TlsSection:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate to test TLS with")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=gyre",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return TlsSection(ca=cert, cert=cert, key=key)


def test_over_tls_the_controller_answers_only_tls_clients(make_cluster, tmp_path: Path, tls: TlsSection) -> None:
    cluster = make_cluster(log_path=tmp_path / "log", tls=tls)
    link = cluster.link("c0", tls=tls)  # the event stream itself runs over TLS
    _record(cluster, 1, "t")
    secure = RemoteLog(cluster.address, secret=cluster.secret, tls=tls)
    assert [r["seq"] for b in secure.read(0) for r in b.to_pylist()] == [0]
    secure.close()
    plain = RemoteLog(cluster.address, secret=cluster.secret)
    with pytest.raises(grpc.RpcError) as refused:
        list(plain.read(0))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    plain.close()
    assert link.connections == 1


def test_a_cell_off_the_cores_host_has_no_weight_file_to_fall_back_on(tmp_path: Path) -> None:
    from gyre.cluster.engine_host import WeightsFetch
    from gyre.cluster.proto import gyre_pb2
    from gyre.errors import TransferError

    fetch = WeightsFetch(ClusterConfig(run_dir=tmp_path / "run"), endpoint=None)
    ref = gyre_pb2.WeightsRef(version=3, location="weights/v000003.safetensors", sha256="0" * 64)
    with pytest.raises(TransferError, match=r"no Mooncake copy was offered.*on the core's host, not here"):
        fetch(ref)
