"""The engine and trainer a cell hosts: an SGLang or Megatron cell that cannot start says so clearly."""

from pathlib import Path

import pytest

from gyre.cluster.address import NodeAddress
from gyre.cluster.config import ClusterConfig, ClusterSection
from gyre.cluster.engine_host import SglangEngineHost
from gyre.config import EngineSection
from gyre.errors import ConfigError


def test_an_sglang_cell_without_sglang_fails_clearly(tmp_path: Path) -> None:
    try:  # the point is the missing `sglang`: skipped where it is installed
        import sglang  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("sglang is installed here; this checks the failure path")
    config = ClusterConfig(run_dir=tmp_path / "run", engine=EngineSection(model=str(tmp_path)),
                           cluster=ClusterSection(engine="sglang", sglang_args=("--tp", "1")))
    log = tmp_path / "cell0.sglang.log"
    with pytest.raises(ConfigError, match="SGLang server exited") as failed:
        SglangEngineHost(config, address=NodeAddress("127.0.0.1", "127.0.0.1"), port=1, log_path=log, timeout_s=60)
    assert str(log) in str(failed.value)
    assert "sglang" in log.read_text()  # the interpreter's own words: no module named sglang


def test_a_megatron_cell_on_a_machine_without_cuda_fails_clearly(tmp_path: Path) -> None:
    import torch

    from gyre.cluster.cell_node import trainer_backend
    from gyre.trainer.errors import BackendUnavailableError

    if torch.cuda.is_available():
        pytest.skip("CUDA is here; this checks the failure path")
    config = ClusterConfig(run_dir=tmp_path / "run", cluster=ClusterSection(trainer="megatron"))
    with pytest.raises(BackendUnavailableError, match="needs CUDA"):
        trainer_backend(config)
