"""The core's TrainerHub driven by hand (a satellite played in-process with its own backend and Mooncake
endpoint): releases on a lost cell, on a lapsed lease (a fake clock) and on leave; landed gradients kept;
nothing counted twice."""

from __future__ import annotations

import pytest
import torch
from satellite_support import Core, backend_config, make_batches, reference_weights

from gyre.model import save_tiny
from gyre.state import TrainerView, replay
from gyre.trainer import TorchBackend, TrainBatch
from gyre.trainer.errors import StepProtocolError
from gyre.transfer import TransferEndpoint
from gyre.transfer.tensors import pull_weights, write_gradients


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    model_dir = save_tiny(root / "model")
    batches = make_batches(groups=2)
    return model_dir, batches, reference_weights(model_dir, batches)


@pytest.fixture(scope="module")
def peer() -> TransferEndpoint:
    return TransferEndpoint()


class Satellite:
    """What SatelliteReplica does, one call at a time."""

    def __init__(self, core: Core, peer: TransferEndpoint, model_dir, cell: str = "sat") -> None:
        self.core, self.peer, self.cell = core, peer, cell
        self.backend = TorchBackend.from_pretrained(model_dir, backend_config())
        joined = core.hub.join(cell, peer.session_id)
        self.slot = joined.slot
        self.backend.load_weights(pull_weights(peer, core.endpoint.session_id, joined.manifest),
                                  policy_version=joined.manifest.version)
        self.backend.zero_grad()
        self.done: list[int] = []

    def work(self) -> int:
        granted = self.core.hub.claim(self.cell, self.backend.policy_version, wait_s=0)
        assert granted.status == "claimed", granted
        result = self.backend.forward_backward(TrainBatch.from_bytes(granted.batch))
        self.core.hub.finish(self.cell, granted.step, granted.micro_step, result)
        self.done.append(granted.micro_step)
        return granted.micro_step

    def land(self, step: int) -> None:
        write_gradients(self.peer, self.core.endpoint.session_id, self.slot, self.backend.gradient_buffers())
        self.core.hub.gradients(self.cell, step, self.done)


def weights_diff(core: Core, reference) -> float:
    return max(float((t - reference[n]).abs().max()) for n, t in core.backend.named_tensors())


def test_a_lost_cell_is_released_at_once_and_its_work_redone(data, peer, tmp_path) -> None:
    model_dir, batches, reference = data
    core = Core.start(tmp_path, model_dir, lease_s=60)
    try:
        step = core.open(batches)
        sat = Satellite(core, peer, model_dir)
        first, second = sat.work(), sat.work()
        sat.land(step)  # even landed gradients are dropped: a dead satellite's slot is not trusted
        assert core.hub.release_cell("sat", "cell lost (controller)") == [first, second]
        released = core.events("micro_step_released")
        assert [(e.micro_step, e.reason) for e in released] == [(first, "cell lost (controller)"),
                                                                (second, "cell lost (controller)")]
        assert core.coordinator.state.current.unclaimed[:2] == [first, second]  # claimable again
        assert core.hub.claim("sat", 0, wait_s=0).status == "released"
        with pytest.raises(StepProtocolError, match="was released"):
            core.hub.finish("sat", step, first, sat.backend.forward_backward(batches[first]))
        core.finish(batches)
        assert weights_diff(core, reference) < 1e-5
        summary = core.events("train_step_finished")[-1]
        assert summary.tokens == sum(b.tokens for b in batches)  # the satellite's results were dropped
        state, _ = replay(TrainerView(), core.log_dir)
        assert state == core.coordinator.state
    finally:
        core.close()


def test_a_lapsed_lease_releases_only_unlanded_work_of_a_silent_satellite(data, peer, tmp_path) -> None:
    model_dir, batches, reference = data
    core = Core.start(tmp_path, model_dir, lease_s=60)
    now = [0.0]
    core.hub.clock = lambda: now[0]
    try:
        core.open(batches)
        sat = Satellite(core, peer, model_dir)
        held = sat.work()
        now[0] = 59.0
        assert core.hub.expire_leases() == []
        assert core.hub.heartbeat("sat")  # renews at 59
        now[0] = 118.0
        assert core.hub.expire_leases() == []
        now[0] = 120.0
        assert core.hub.expire_leases() == ["sat"]
        assert [(e.micro_step, e.cell_id) for e in core.events("micro_step_released")] == [(held, "sat")]
        assert "lease expired" in core.events("micro_step_released")[0].reason
        core.finish(batches)
        assert weights_diff(core, reference) < 1e-5
    finally:
        core.close()


def test_leaving_with_landed_gradients_keeps_them(data, peer, tmp_path) -> None:
    model_dir, batches, reference = data
    core = Core.start(tmp_path, model_dir, lease_s=60)
    try:
        step = core.open(batches)
        sat = Satellite(core, peer, model_dir)
        sat.work()
        sat.work()
        with pytest.raises(StepProtocolError, match=r"reported gradients of micro-steps \[0\]"):
            core.hub.gradients("sat", step, sat.done[:1])
        sat.land(step)
        core.hub.leave("sat", "back to rollout")
        assert not core.events("micro_step_released")
        core.finish(batches)
        assert weights_diff(core, reference) < 1e-5
        finishes = [e.cell_id for e in core.events("micro_step_finished")]
        assert finishes.count("sat") == 2 and len(finishes) == len(batches)
        assert [e.reason for e in core.events("satellite_left")] == ["back to rollout"]
    finally:
        core.close()


def test_a_satellite_is_told_to_pull_the_open_steps_weights(data, peer, tmp_path) -> None:
    model_dir, batches, _ = data
    core = Core.start(tmp_path, model_dir, lease_s=60)
    try:
        core.open(batches)
        Satellite(core, peer, model_dir)
        core.finish(batches)  # the core alone: version 1 is published
        step = core.open(batches)
        granted = core.hub.claim("sat", 0, wait_s=0)
        assert (granted.status, granted.step, granted.manifest.version) == ("weights", step, 1)
        pulled = pull_weights(peer, core.endpoint.session_id, granted.manifest)
        assert all(torch.equal(pulled[n], t) for n, t in core.backend.named_tensors())
        assert core.hub.claim("sat", 1, wait_s=0).status == "claimed"
    finally:
        core.close()


def test_two_satellites_over_grpc_one_leaving_mid_step(data, tmp_path) -> None:
    """SatelliteReplica in threads of this process (the process tests spawn one): two of them, three steps,
    one leaves in the middle of step 1 once it finished a micro-step (its gradients then land on the way out);
    every step still equals one replica's."""
    from gyre.cluster.satellite import SatelliteReplica
    from gyre.cluster.trainer_service import weights_ref

    model_dir, batches, _ = data
    core = Core.start(tmp_path, model_dir, lease_s=60)
    sats = [SatelliteReplica(cell_id=f"sat-{i}", backend=TorchBackend.from_pretrained(model_dir, backend_config()),
                             endpoint=TransferEndpoint(), secret=core.secret) for i in range(2)]
    reference = TorchBackend.from_pretrained(model_dir, backend_config())
    try:
        prepulled = weights_ref(core.hub, core.hub.publisher.manifest())  # as the controller's JoinStep names it
        for s, weights in zip(sats, (prepulled, None), strict=True):
            assert s.join(core.server.address, weights)["weights_bytes"] > 0
        joins = {e.cell_id: e.transfer_s for e in core.events("satellite_joined")}
        assert joins["sat-0"] > 0 and joins["sat-1"] == 0  # only a satellite that pulled before joining says so
        for step in range(3):
            core.open(batches)
            if step == 1:  # the core is idle: the first micro-step finished is a satellite's
                core.wait_for(lambda: any(e.step == 1 for e in core.events("micro_step_finished")),
                              "a satellite's work in step 1")
                leaving = next(e.cell_id for e in core.events("micro_step_finished") if e.step == 1)
                next(s for s in sats if s.cell_id == leaving).leave("mid-step")
            core.finish(batches)
            reference.zero_grad()
            for b in batches:
                reference.forward_backward(b)
            reference.optimizer_step(normalizer=float(len({e for b in batches for e in b.execution_ids})))
            want = dict(reference.named_tensors())
            assert max(float((t - want[n]).abs().max()) for n, t in core.backend.named_tensors()) < 1e-5
        finished = core.events("micro_step_finished")
        assert len(finished) == 3 * len(batches)
        assert not core.events("micro_step_released")  # sat-1 left with everything landed: its work is kept
        assert [(e.cell_id, e.reason) for e in core.events("satellite_left")] == [(leaving, "mid-step")]
        assert {e.cell_id for e in finished if e.step == 1} >= {leaving}
        state, _ = replay(TrainerView(), core.log_dir)
        assert state == core.coordinator.state
    finally:
        for s in sats:
            s.leave("test over")
        core.close()


def test_the_trainer_is_served_only_once_its_weights_are_published(data, tmp_path, monkeypatch) -> None:
    """A Join that found the hub before the core's first publish was refused for good ("no weights are
    published yet", FAILED_PRECONDITION: chaos seed 8); until the hub is served, a Join is told "not ready yet"
    (UNAVAILABLE), which the controller retries."""
    from gyre.trainer.hub import TrainerHub

    seen: list[object] = []
    publish = TrainerHub.publish

    def watched(hub: TrainerHub, *args, **kwargs):
        seen.append(core_server[0].hub)  # what a Join arriving now would be served
        return publish(hub, *args, **kwargs)

    monkeypatch.setattr(TrainerHub, "publish", watched)
    from gyre.cluster import trainer_service

    core_server: list[trainer_service.TrainerServer] = []
    real = trainer_service.TrainerServer.attach

    def attach(server, *args, **kwargs):
        core_server.append(server)
        return real(server, *args, **kwargs)

    monkeypatch.setattr(trainer_service.TrainerServer, "attach", attach)
    model_dir, _, _ = data
    core = Core.start(tmp_path, model_dir, lease_s=60)
    try:
        assert seen == [None]  # published once, before the hub was served
        assert core.server.hub is core.hub and core.hub.publisher.versions == [0]
    finally:
        core.close()


def test_a_join_waits_for_its_pull_on_the_core_link_and_records_what_it_took(data, peer, tmp_path) -> None:
    """On an emulated core whose link is shared, the Trainer service answers a satellite's Join only once its
    pull is through the link (`gyre.emulate.Pacer.transfer`), and `satellite_joined` carries that time, as the
    simulator's event does."""
    import threading

    from gyre.cluster.auth import metadata
    from gyre.cluster.proto import gyre_pb2, gyre_pb2_grpc
    from gyre.cluster.tls import channel

    pulling, through = threading.Event(), threading.Event()

    def pull() -> float:
        pulling.set()
        assert through.wait(120), "the test never let the pull through"
        return 2.5

    model_dir, batches, _ = data
    core = Core.start(tmp_path, model_dir, lease_s=60, join_transfer=pull)
    replies: list = []
    try:
        core.open(batches)
        stub = gyre_pb2_grpc.TrainerStub(channel(core.server.address, None))
        request = gyre_pb2.TrainerJoin(cell_id="sat", transfer_session=peer.session_id, transfer_s=0.25)
        caller = threading.Thread(target=lambda: replies.append(stub.Join(request, metadata=metadata(core.secret),
                                                                          timeout=120)))
        caller.start()
        assert pulling.wait(120)
        assert not core.events("satellite_joined") and not replies  # not a member while its pull is on the link
        through.set()
        caller.join(120)
        assert replies and replies[0].step == 0
        (joined,) = core.events("satellite_joined")
        assert joined.cell_id == "sat" and joined.transfer_s == pytest.approx(2.75)
    finally:
        through.set()
        core.close()
