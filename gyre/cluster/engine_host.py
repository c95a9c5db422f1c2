"""The engine a cell hosts: the CPU engine in the cell's process, or an SGLang server it launches (GPU cells).

Both are reached the same way — SGLang's native HTTP API at ``url`` (the proxy generates there; the cell
pauses, releases and resumes through `SyncHttpEngineClient`) — and differ only in how a published version
gets in:
- `LocalEngineHost`: the cell pulls the version's bytes from the core over Mooncake (`WeightsFetch`) and
  installs the tensors in-process; the durable file is read only where it is (the core's host).
- `SglangEngineHost`: SGLang loads weights from disk or over its own NCCL group, not from host tensors, so
  the cell pulls the version the same way, writes it as a Hugging Face checkpoint on its own disk (`gyre
  export`'s code) and calls `/update_weights_from_disk` with it; the server is started with
  `--enable-memory-saver`, which `/release_memory_occupation` needs. Written against SGLang's documented
  server arguments and endpoints (references.md §1, §9); not runnable here (no GPU, no SGLang install).

Both engines report the version that served each call (``meta_info.weight_version``): they start named
version 0, and a load names the version it installs. A load while the engine serves finishes every request
in flight on the old weights first and admits none meanwhile (``drain_s``): SGLang's generate requests hold
its model-update lock for their whole run, and the CPU engine drains the same way (`Scheduler.call_when_idle`),
so one call is never served by two versions.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from gyre.cluster.address import NodeAddress
from gyre.cluster.config import ClusterConfig
from gyre.cluster.proto import gyre_pb2
from gyre.engine.protocol import INITIAL_WEIGHT_VERSION
from gyre.errors import ConfigError, TransferError

log = logging.getLogger(__name__)

class EngineHost(Protocol):
    url: str
    local_engine: Any
    """The in-process `LocalEngine`, or None (an engine in another process)."""

    def load_weights(self, ref: gyre_pb2.WeightsRef) -> dict[str, float]:
        """Bring the engine to ``ref.version``; returns ``weights_bytes`` and ``weights_s``."""
        ...

    def stop(self) -> None: ...


class WeightsFetch:
    """A published version's tensors on this cell: pulled from the core over Mooncake; the durable file only
    when this host has it (the core's host: the core wrote it). On another host there is no file to fall back
    on: the pull's failure is the error (the command fails, and the controller's fault handling takes over)."""

    def __init__(self, config: ClusterConfig, endpoint: Any) -> None:
        self.config, self.endpoint = config, endpoint
        self._puller: Any = None

    def __call__(self, ref: gyre_pb2.WeightsRef) -> dict[str, Any]:
        pulled: TransferError | None = None
        if ref.peer_session and ref.manifest:
            from gyre.transfer.tensors import WeightsPuller

            if self._puller is None:
                self._puller = WeightsPuller(self.endpoint)  # one registered buffer for every version served
            try:
                return self._puller.pull(ref.peer_session, ref.manifest)  # views: the caller copies them
            except TransferError as error:
                pulled = error
        from gyre.trainer.weights import WeightStore

        store = WeightStore(Path(self.config.run_dir))
        if not (store.run_dir / ref.location).exists():
            why = f"pulling it from {ref.peer_session} failed: {pulled}" if pulled else "no Mooncake copy was offered"
            raise TransferError(f"weights v{ref.version}: {why}, and {ref.location} is on the core's host, not here")
        if pulled is not None:
            log.warning("pulling weights v%d from %s failed (%s); reading %s", ref.version, ref.peer_session,
                        pulled, ref.location)
        return store.load(ref.location, ref.sha256)


class LocalEngineHost:
    def __init__(self, config: ClusterConfig, endpoint: Any, address: NodeAddress) -> None:
        import dataclasses

        from gyre.engine.local import LocalEngine, LocalEngineServer
        from gyre.run.build import engine_config
        from gyre.transfer import EndpointConfig

        self.config, self.endpoint = config, endpoint
        engine = engine_config(config, config.cluster.cell_threads, config.emulation())  # its KV port: peers dial it
        engine = dataclasses.replace(engine, transfer=EndpointConfig(hostname=address.advertise))
        self.local_engine = LocalEngine(engine)
        self._server = LocalEngineServer(self.local_engine, host=address.bind)
        self._server.start()
        self.url = f"http://{address.endpoint(self._server.port)}"
        self.local_engine.set_weight_version(INITIAL_WEIGHT_VERSION)  # before the proxy knows the engine
        self._fetch = WeightsFetch(config, endpoint)

    def load_weights(self, ref: gyre_pb2.WeightsRef) -> dict[str, float]:
        started = time.perf_counter()
        tensors = self._fetch(ref)
        installed = self.local_engine.load_weights(tensors, version=str(ref.version), drain=True)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"weights_bytes": float(nbytes), "weights_s": time.perf_counter() - started,
                "drain_s": installed.drain_s}

    def stop(self) -> None:
        self._server.stop()


class SglangEngineHost:
    """An SGLang server launched by the cell (``python -m sglang.launch_server``), token ids in and out."""

    def __init__(self, config: ClusterConfig, *, address: NodeAddress, port: int, log_path: Path, endpoint: Any = None,
                 timeout_s: float = 600.0) -> None:
        import httpx

        self.config = config
        self._fetch = WeightsFetch(config, endpoint)
        self.local_engine = None
        self.run_dir = Path(config.run_dir)
        model = self._model_dir()
        self.url = f"http://{address.endpoint(port)}"
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", address.bind,
                "--port", str(port), "--skip-tokenizer-init", "--enable-memory-saver",
                *config.cluster.sglang_args]
        with open(log_path, "ab") as out:
            self._process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=dict(os.environ))
        deadline = time.monotonic() + timeout_s
        while True:  # SGLang loads the model and captures CUDA graphs before /health answers
            if self._process.poll() is not None:
                raise ConfigError(f"the SGLang server exited with {self._process.returncode}; see {log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"the SGLang server did not become healthy within {timeout_s:g} s; see {log_path}")
            time.sleep(1.0)
        from gyre.engine import SyncHttpEngineClient

        with SyncHttpEngineClient(self.url) as client:  # its calls report the version they ran on, from v0
            client.update_weight_version(INITIAL_WEIGHT_VERSION)

    def _model_dir(self) -> Path:
        model = self.config.engine.model
        if model != "tiny":
            return Path(model)  # the checkpoint directory, at the same path on every host
        from gyre.trainer.export import write_checkpoint

        return write_checkpoint(self.config, None, self.run_dir / "engine" / "v000000.hf", 0)

    def load_weights(self, ref: gyre_pb2.WeightsRef) -> dict[str, float]:
        from gyre.engine import SyncHttpEngineClient
        from gyre.trainer.export import write_checkpoint

        started = time.perf_counter()  # pulled from the core, written on this host's disk for SGLang to read
        path = write_checkpoint(self.config, self._fetch(ref), self.run_dir / "engine" / f"v{ref.version:06d}.hf",
                                ref.version)
        exported = time.perf_counter()
        with SyncHttpEngineClient(self.url) as client:  # SGLang's update waits for the requests in flight
            response = client.update_weights_from_disk(str(path), version=str(ref.version))
        if not response.success:
            raise RuntimeError(f"SGLang refused weights v{ref.version} from {path}: {response.message}")
        nbytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        done = time.perf_counter()
        return {"weights_bytes": float(nbytes), "weights_s": done - started, "drain_s": 0.0,
                "update_s": done - exported}

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
