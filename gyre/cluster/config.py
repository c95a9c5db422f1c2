"""`gyre run` configuration: a `gyre train` config plus `[cluster]` (the cells) and a wider `[scheduler]`.

One file describes the whole run; the controller and every process it starts read the same file, each
taking its own section (a cell its slots and whether it is the core, the proxy the rollout settings).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import (
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gyre.cluster.address import WILDCARDS
from gyre.cluster.tls import TlsSection
from gyre.config import SchedulerSection, TrainConfig, _Section, apply_overrides
from gyre.emulate import Emulation
from gyre.errors import ConfigError
from gyre.scheduler import get_policy


class RaySection(_Section):
    """``launcher = "ray"``: where the Ray cluster is and what each cell's bundle reserves."""

    address: str = Field("", description="Ray head to join (\"auto\", or HOST:PORT); empty: start a local one")
    cpus_per_cell: PositiveFloat = Field(1.0, description="CPUs each cell's placement-group bundle reserves")
    gpus_per_cell: NonNegativeInt = Field(0, description="GPUs each cell's bundle reserves (GPU nodes)")
    proxy_cpus: PositiveFloat = Field(1.0, description="CPUs the proxy's bundle reserves (it runs the harnesses)")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "SPREAD", description="placement-group strategy: SPREAD puts cells on different nodes where it can")
    namespace: str = Field("gyre", description="Ray namespace of the run's detached actors (`--resume` finds them)")


class ClusterSection(_Section):
    """The cells of the run: ``cells`` of ``slots`` executions each; ``core`` owns weights and optimizer."""

    cells: PositiveInt = Field(4, description="cell processes (cell0 .. cellN-1)")
    slots: PositiveInt = Field(4, description="concurrent executions a rollout cell serves")
    core: str = Field("cell0", description="the cell that owns weights and optimizer")
    bind: str = Field("127.0.0.1", description="interface every server of a process binds (loopback by default; "
                      "0.0.0.0: every interface); `--bind` overrides it per process")
    advertise: str = Field("", description="address peers reach a process at (default: bind; with a wildcard "
                           "bind, the address routed toward the controller); `--advertise` per process")
    port: NonNegativeInt = Field(0, description="the controller's gRPC port (0: any free port)")
    launcher: Literal["local", "ray", "manual"] = Field(
        "local", description="who starts the cells and the proxy: local subprocesses, Ray actors placed by a "
                             "placement group, or nobody (started by hand: `gyre cell --controller HOST:PORT`)")
    ray: RaySection = RaySection()
    tls: TlsSection | None = Field(None, description="gRPC over TLS (ca, cert, key PEM paths on every host)")
    heartbeat_s: PositiveFloat | None = Field(
        None, description="silence after which a process's heartbeat says it lives (default dead_after_s / 3)")
    dead_after_s: PositiveFloat = Field(30.0, description="silence after which a cell counts as lost")
    start_timeout_s: PositiveFloat = Field(180.0, description="how long the processes may take to connect")
    lease_s: PositiveFloat = Field(30.0, description="a satellite silent this long loses its claimed micro-steps "
                                   "to the other replicas (it renews the lease while it works)")
    cell_threads: PositiveInt = Field(1, description="torch threads of each cell process")
    engine: Literal["local", "sglang"] = Field(
        "local", description="the engine each cell hosts: the CPU engine, or an SGLang server it launches (GPU)")
    sglang_args: tuple[str, ...] = Field((), description="extra `sglang.launch_server` arguments (e.g. --tp 8)")
    trainer: Literal["torch", "megatron"] = Field(
        "torch", description="each cell's trainer replica: the torch backend, or Megatron-core on CUDA (GPU)")

    @property
    def cell_ids(self) -> list[str]:
        return [f"cell{i}" for i in range(self.cells)]

    @property
    def heartbeat_period_s(self) -> float:
        """How long a link may send nothing before it beats: ``heartbeat_s``, else ``dead_after_s / 3``.

        Detection is bounded by ``dead_after_s`` whatever the period (a peer is lost after that long silent), so
        beating more often only adds messages: at 1 s they were over half of what the controller's loop read at
        256 cells. A third of it leaves two heartbeats to lose or delay before a live peer would be declared
        lost (Kafka's rule for its consumers' heartbeat.interval.ms against session.timeout.ms)."""
        return self.heartbeat_s if self.heartbeat_s is not None else self.dead_after_s / 3

    @model_validator(mode="after")
    def _core_is_a_cell(self) -> Self:
        if self.core not in self.cell_ids:
            raise ValueError(f"cluster.core {self.core!r} is not one of the cells {self.cell_ids}")
        if self.advertise and self.advertise in WILDCARDS:
            raise ValueError(f"cluster.advertise {self.advertise!r} is a wildcard: name an address peers can reach")
        if self.heartbeat_period_s >= self.dead_after_s:
            raise ValueError(f"cluster.heartbeat_s ({self.heartbeat_s}) must be below cluster.dead_after_s "
                             f"({self.dead_after_s}): a live process would be declared lost between two heartbeats")
        if self.launcher == "manual" and self.port == 0:
            raise ValueError("cluster.launcher = 'manual' needs cluster.port: processes started by hand dial it")
        return self


class ClusterSchedulerSection(SchedulerSection):
    """The policy the controller runs, with its parameters (the same `decide(view, params)` as the simulator)."""

    policy: str = Field("elastic", pattern="^(elastic|colocate|async)$")
    params: dict[str, Any] = Field(default_factory=dict, description="the policy's parameters (gyre.scheduler.params)")

    @field_validator("params")
    @classmethod
    def _json(cls, value: dict[str, Any]) -> dict[str, Any]:
        json.dumps(value)
        return value

    @field_validator("version")
    @classmethod
    def _shipped(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Refused here, before any process starts, in the words `get_policy` uses (it names the shipped ones)."""
        if value is not None and "policy" in info.data:
            get_policy(info.data["policy"], value)
        return value


class EmulateSection(_Section):
    """``[emulate]``: every cell takes the time one cell of ``scenario``'s cluster would (`gyre.emulate`)."""

    scenario: str = Field(description="a scenario name (replay/scenarios) or file whose accelerator cells emulate")
    time_scale: PositiveFloat = Field(1.0, description="emulated seconds per wall second")
    token_scale: PositiveFloat = Field(1.0, description="scenario tokens one real token stands for")
    max_overrun_share: float = Field(0.05, ge=0.0, le=1.0, description=(
        "real compute over its emulated time, as a share of that time, beyond which the run's figures are "
        "marked invalid"))

    def emulation(self) -> Emulation:
        from gyre.sim.emulation import accelerator
        from gyre.sim.scenario import load_scenario

        scenario = load_scenario(self.scenario)
        return Emulation(accelerator=accelerator(scenario), time_scale=self.time_scale, token_scale=self.token_scale,
                         source=scenario.name)


class ClusterConfig(TrainConfig):
    cluster: ClusterSection = ClusterSection()
    scheduler: ClusterSchedulerSection = ClusterSchedulerSection()  # type: ignore[assignment]
    emulate: EmulateSection | None = None

    def emulation(self) -> Emulation | None:
        """The accelerator every cell emulates (None: cells run at the host's speed)."""
        return self.emulate.emulation() if self.emulate is not None else None

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.scheduler.policy == "async" and self.cluster.cells < 2:
            raise ValueError("scheduler.policy async needs at least two cells (a rollout and a training pool)")
        if self.emulate is not None:
            try:
                self.emulate.emulation()
            except ConfigError as error:
                raise ValueError(f"emulate.scenario: {error}") from None
        return self

    def policy_params(self) -> dict[str, Any]:
        params = dict(self.scheduler.params)
        if self.scheduler.staleness:
            params.setdefault("staleness", self.scheduler.staleness)
        return params

    kind: ClassVar[str] = "cluster"

    @classmethod
    def load(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> Self:
        """A TOML file (as `gyre train` reads), or the JSON a controller writes for the processes it starts."""
        path = Path(path)
        if path.suffix != ".json":
            return super().load(path, overrides)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config file at {path}") from None
        except ValueError as error:
            raise ConfigError(f"invalid cluster config {path}: {error}") from error
        # the command line's keys apply to a JSON config too (`gyre run X.json --steps 5` ignored them)
        return cls.validated(apply_overrides(data, overrides), f"{path}", set(overrides or ()))
