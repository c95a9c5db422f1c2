"""Emulated accelerators (`gyre.emulate`): the costs are the simulator's, the pacer holds work to them, and
the CPU engine's steps are priced by what they computed."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre.cluster.config import ClusterConfig
from gyre.emulate import Accelerator, Emulation, PacedBackend, Pacer
from gyre.engine import SamplingParams, SyncHttpEngineClient
from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
from gyre.errors import ConfigError
from gyre.sim.calls import CallTiming
from gyre.sim.emulation import accelerator
from gyre.sim.scenario import load_scenario
from gyre.trainer.loss import LossStats
from gyre.trainer.protocol import MicroStepResult

ACCEL = Accelerator(step_ms=30, per_request_ms=1.6, per_mtoken_ms=16.64, prefill_s_per_mtoken=30,
                    train_s_per_mtoken=50, optimizer_s=15, publish_s=15, satellite_join_s=7.5, to_training_s=2.13,
                    to_rollout_s=0.865, kv_bytes_per_token=100_000, kv_gb_per_s=50)


def test_a_scenario_accelerator_prices_decode_and_prefill_as_the_simulator_does() -> None:
    scenario = load_scenario("seed-2.4t-scaled")
    acc, timing = accelerator(scenario), CallTiming(scenario)
    for n, context in [(1, 0), (2, 175_000), (4, 350_000)]:
        assert acc.decode_iteration_s(n, context) == pytest.approx(timing.step_ms(n, context) / 1e3)
    assert acc.prefill_s_per_mtoken == pytest.approx(timing.prefill_s_per_token * 1e6)
    assert acc.train_s_per_mtoken == pytest.approx(scenario.training.cell_s_per_mtoken(scenario.cluster.gpus_per_cell))
    assert (acc.to_training_s, acc.to_rollout_s) == (scenario.switch.to_training_s, scenario.switch.to_rollout_s)


def test_a_real_token_stands_for_token_scale_tokens_of_the_scenario() -> None:
    """One real decode iteration at scale k is k iterations of the accelerator at k times the context."""
    one, ten = Emulation(accelerator=ACCEL), Emulation(accelerator=ACCEL, token_scale=10)
    assert ten.engine_step_s(2, 1_000, 0) == pytest.approx(10 * one.engine_step_s(2, 10_000, 0))
    assert ten.engine_step_s(0, 0, 500) == pytest.approx(one.engine_step_s(0, 0, 5_000)) == pytest.approx(0.15)
    assert one.engine_step_s(0, 0, 0) == 0.0  # nothing computed: nothing charged
    assert ten.train_s(100_000, cells=2) == pytest.approx(1e6 * 50 / 1e6 / 2)


def test_the_pacer_waits_out_the_emulated_time_and_counts_what_overran() -> None:
    now, slept = [0.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    pacer = Pacer(Emulation(accelerator=ACCEL, time_scale=10), sleep=sleep, clock=lambda: now[0])
    started = now[0]
    now[0] += 0.2  # 0.2 s of real work standing for 5 emulated seconds: 0.5 s of wall time
    assert pacer.hold(started, 5.0) == pytest.approx(0.3) and slept == [pytest.approx(0.3)]
    started = now[0]
    now[0] += 1.0  # the real work took longer than its emulated 5 s (0.5 s of wall time)
    assert pacer.hold(started, 5.0) == 0.0 and len(slept) == 1
    s = pacer.snapshot()
    assert (s["holds"], s["overruns"]) == (2, 1) and s["emulated_s"] == pytest.approx(10.0)
    assert s["overrun_s"] == pytest.approx(0.5) and s["overrun_share"] == pytest.approx(0.5)


def test_a_steps_batch_building_overlaps_its_next_micro_steps_accelerator_time() -> None:
    """Host work before a micro-step (its batch, built from the log) counts inside that micro-step's hold, as
    a data loader's work overlaps the accelerator's; once only: the micro-step after pays its whole time."""
    now, slept = [0.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    class Backend:
        def forward_backward(self, batch: object) -> MicroStepResult:
            now[0] += 0.1  # real compute
            return MicroStepResult(index=0, tokens=1, padded_tokens=1, passes=1, stats=LossStats(), duration_s=0.1)

    class Batch:
        tokens = 100_000  # 5 emulated seconds at 50 s per Mtoken: 0.5 s of wall time at time_scale 10

    paced = PacedBackend(Backend(), Pacer(Emulation(accelerator=ACCEL, time_scale=10), sleep=sleep,
                                          clock=lambda: now[0]))
    now[0] += 0.3  # building the step's batch
    paced.host_work(0.3)
    first = paced.forward_backward(Batch())
    assert slept == [pytest.approx(0.1)]  # 0.5 s of wall, of which the build had 0.3 and the compute 0.1
    second = paced.forward_backward(Batch())
    assert slept[-1] == pytest.approx(0.4)
    # each reports the accelerator's time (the policies weigh lending by it), not the 0.1 s of real compute
    assert first.duration_s == pytest.approx(0.5) and second.duration_s == pytest.approx(0.5)


def test_the_cpu_engine_charges_each_step_what_it_computed() -> None:
    """A prompt of P tokens and N tokens out: one prefill step, then N - 1 decode steps of one request whose
    context grows by a token each; with token_scale k, all at k times the counts."""
    k, prompt, out = 50.0, list(range(10, 40)), 12
    emulation = Emulation(accelerator=ACCEL, time_scale=1000.0, token_scale=k)
    server = LocalEngineServer(LocalEngine(LocalEngineConfig(seed=0, emulation=emulation)))
    server.start()
    try:
        with SyncHttpEngineClient(server.url) as client:
            result = client.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=out, ignore_eos=True))
        assert len(result.output_ids) == out
        snapshot = server.engine.scheduler.snapshot()
    finally:
        server.stop()
    expected = len(prompt) * k * ACCEL.prefill_s_per_mtoken / 1e6 + sum(
        k * ACCEL.decode_iteration_s(1, (len(prompt) + j) * k) for j in range(1, out))
    emulated = snapshot["emulation"]
    assert emulated["holds"] == snapshot["steps"] == out
    assert emulated["emulated_s"] == pytest.approx(expected)


def test_the_cpu_engines_host_work_between_steps_counts_inside_the_accelerators_time() -> None:
    """Back-to-back steps are paced from the end of the previous one, so the host's work between them
    (sampling, replies, admission) overlaps the accelerator's time instead of adding to it: a busy engine
    decodes at the emulated rate. A fake clock moves only by the pacer's sleeps and by 3 ms of host work
    after each step's sampling; without the overlap the call would last ``out`` times 3 ms longer."""
    k, prompt, out, host = 50.0, list(range(10, 40)), 12, 0.003
    emulation = Emulation(accelerator=ACCEL, time_scale=100.0, token_scale=k)  # a step: >= 15 ms of wall
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    server = LocalEngineServer(LocalEngine(LocalEngineConfig(seed=0, emulation=emulation)))
    scheduler = server.engine.scheduler
    scheduler.pacer = Pacer(emulation, sleep=sleep, clock=lambda: now[0])
    sample = scheduler._sample

    def sample_then_host_work(seq, logits):  # type: ignore[no-untyped-def]
        sample(seq, logits)
        now[0] += host

    scheduler._sample = sample_then_host_work  # type: ignore[method-assign]
    server.start()
    try:
        with SyncHttpEngineClient(server.url) as client:
            client.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=out, ignore_eos=True))
        emulated = scheduler.snapshot()["emulation"]
    finally:
        server.stop()
    assert emulated["holds"] == out and emulated["overruns"] == 0
    # every step's host work hid in the next step's hold; only the last step's is outside any
    assert now[0] == pytest.approx(emulation.wall_s(emulated["emulated_s"]) + host)


def test_an_emulated_cluster_names_an_unknown_scenario(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text('[emulate]\nscenario = "nope"\n')
    with pytest.raises(ConfigError, match=r"emulate.scenario.*unknown scenario 'nope'"):
        ClusterConfig.load(path)
    path.write_text('[emulate]\nscenario = "seed-2.4t-scaled"\ntime_scale = 20\ntoken_scale = 100\n')
    config = ClusterConfig.load(path)
    emulation = config.emulation()
    assert emulation is not None and emulation.source == "seed-2.4t-scaled" and emulation.token_scale == 100



def test_the_run_view_sums_each_incarnations_last_report() -> None:
    """Reports are cumulative per incarnation: the last one counts; a restarted cell's add to its
    predecessor's; the overrun share is over the wall time the held work should have taken."""
    from gyre.events.models import EmulationReported
    from gyre.state.run import RunView

    def report(incarnation: str, emulated: float, real: float, waited: float, overrun: float) -> EmulationReported:
        return EmulationReported(cell_id="cell1", incarnation=incarnation, holds=10, emulated_s=emulated,
                                 real_s=real, waited_s=waited, overrun_s=overrun, overruns=int(overrun > 0))

    view = RunView()
    state = view.initial()
    assert state.emulation_totals() is None
    for event in [report("a", 10, 0.2, 0.8, 0.0), report("a", 20, 1.0, 1.0, 0.0), report("b", 10, 1.5, 0.0, 0.5)]:
        state = view.apply(state, event)
    totals = state.emulation_totals()
    assert totals is not None and totals["emulated_s"] == 30 and totals["holds"] == 20
    assert totals["overrun_share"] == pytest.approx(0.5 / (2.5 + 1.0 - 0.5))
