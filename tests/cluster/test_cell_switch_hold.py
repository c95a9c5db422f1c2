"""On an emulated accelerator a role switch's cell side is held from its first part, as `gyre sim` times a
switch: the real work of pausing the engine (or leaving the trainer) falls inside the held ``to_training_s``
(``to_rollout_s``), not on top of it. The parts here take at least a known real time (a sleep *inside* the
work, never a race), so the hold's wait is bounded whatever the machine's load."""

import time
from types import SimpleNamespace

from gyre.cluster.cell_node import CellNode
from gyre.cluster.proto import gyre_pb2
from gyre.emulate.clock import Accelerator, Emulation, Pacer

PART_S = 0.2
ACCEL = Accelerator(step_ms=30, per_request_ms=1.6, per_mtoken_ms=16.64, prefill_s_per_mtoken=30,
                    train_s_per_mtoken=50, optimizer_s=15, publish_s=15, satellite_join_s=0, to_training_s=200,
                    to_rollout_s=100, kv_bytes_per_token=100_000, kv_gb_per_s=50)


class Engine:
    """The engine's control calls; pausing it and loading weights take ``PART_S`` of real work."""

    def __init__(self) -> None:
        self.released = False

    def pause(self, mode: str) -> None:
        time.sleep(PART_S)

    def release_memory_occupation(self) -> None:
        self.released = True

    def resume_memory_occupation(self) -> None:
        self.released = False

    def resume(self) -> None:
        pass


def cell() -> CellNode:
    node = object.__new__(CellNode)  # the switch's parts only: no controller, engine process or trainer
    engine = Engine()
    node.engine_client = engine
    node.engine = SimpleNamespace(local_engine=engine, load_weights=lambda ref: time.sleep(PART_S) or {})
    node.satellite, node.cell_id = None, "cell1"
    node.pacer = Pacer(Emulation(accelerator=ACCEL, time_scale=10), sleep=lambda s: None)
    return node


def test_a_switch_to_training_is_held_from_its_pause() -> None:
    node = cell()
    node._to_training(gyre_pb2.ToTraining(pause_mode="abort"))
    assert node.pacer.stats.holds == 1
    assert node.pacer.stats.waited_s <= ACCEL.to_training_s / 10 - PART_S  # the pause counted inside


def test_a_return_to_rollout_is_held_from_its_first_part() -> None:
    node = cell()
    node.engine_client.released = True
    node._to_rollout(gyre_pb2.ToRollout(leave=True, weights=gyre_pb2.WeightsRef(version=1)))
    assert node.pacer.stats.holds == 1
    assert node.pacer.stats.waited_s <= ACCEL.to_rollout_s / 10 - PART_S  # the load counted inside
