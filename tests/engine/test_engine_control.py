"""Control endpoints: abort, pause/continue in every mode, weight updates from disk and from tensors."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from engine_helpers import hf_greedy, wait_for

from gyre.engine import EngineHTTPError, GenerateResult, SamplingParams, SyncHttpEngineClient
from gyre.engine.local import LocalEngineServer
from gyre.model import build_tiny_model, save_tiny
from tests.conftest import HANG_S

LONG = SamplingParams(temperature=0.0, max_new_tokens=3000, ignore_eos=True)


def stats(server: LocalEngineServer) -> dict:
    return httpx.get(server.url + "/gyre/stats").json()


class Background:
    """A generate call on its own thread and connection."""

    def __init__(self, server: LocalEngineServer, ids: list[int], params: SamplingParams, rid: str) -> None:
        self.result: GenerateResult | None = None

        def run() -> None:
            with SyncHttpEngineClient(server.url) as c:
                self.result = c.generate(ids, params, rid=rid)

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def join(self) -> GenerateResult:
        self.thread.join(HANG_S)
        assert self.result is not None
        return self.result


def test_abort_running_request_returns_partial_output(server, client, prompt) -> None:
    held = server.engine.scheduler.hold(5)  # the reply cannot end before the abort lands
    bg = Background(server, prompt("long"), LONG, rid="victim")
    assert held.wait(HANG_S)
    client.abort("victim")
    server.engine.scheduler.release_hold()
    r = bg.join()
    assert r.finish_reason is not None and r.finish_reason.type == "abort"
    assert 0 < len(r.output_ids) < 3000
    assert len(r.output_ids) == 5  # one token per step: the abort landed where the loop held
    assert len(r.output_logprobs or []) == len(r.output_ids)


def test_abort_waiting_request_and_abort_all(server, client, prompt) -> None:
    client.pause("in_place")
    a = Background(server, prompt("a"), LONG, rid="a")
    b = Background(server, prompt("b"), LONG, rid="b")
    wait_for(lambda: stats(server)["waiting"] == 2)
    client.abort("a")
    ra = a.join()
    assert ra.finish_reason is not None and ra.finish_reason.type == "abort" and ra.output_ids == []
    client.abort_all()
    rb = b.join()
    assert rb.finish_reason is not None and rb.finish_reason.type == "abort"
    client.resume()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_freezes_generation_and_continue_finishes_identically(server, client, prompt, mode) -> None:
    ids = prompt("pause me")
    params = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)
    expected = client.generate(ids, params).output_ids
    client.flush_cache()
    held = server.engine.scheduler.hold(3)  # mid-generation, however slow the machine: the pause lands there
    bg = Background(server, ids, params, rid="paused")
    assert held.wait(HANG_S)
    client.pause(mode)
    frozen = stats(server)["steps"]
    server.engine.scheduler.release_hold()  # from here only the pause keeps the engine from stepping
    assert stats(server)["paused"] and stats(server)["running"] == 1
    httpx.get(server.url + "/health")  # the server keeps answering while paused
    assert stats(server)["steps"] == frozen
    client.resume()
    r = bg.join()
    assert r.finish_reason is not None and r.finish_reason.type == "length"
    assert r.output_ids == expected


def test_pause_in_abort_mode_aborts_in_flight(server, client, prompt) -> None:
    held = server.engine.scheduler.hold(3)
    bg = Background(server, prompt("doomed"), LONG, rid="doomed")
    assert held.wait(HANG_S)
    client.pause("abort")
    server.engine.scheduler.release_hold()
    r = bg.join()
    assert r.finish_reason is not None and r.finish_reason.type == "abort"
    queued = Background(server, prompt("queued"), SamplingParams(max_new_tokens=3), rid="queued")
    wait_for(lambda: stats(server)["waiting"] == 1)  # new requests wait while paused
    client.resume()
    assert queued.join().completion_tokens == 3


def test_update_weights_from_disk(server, client, prompt, tmp_path: Path) -> None:
    ids = prompt("weights")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    before = client.generate(ids, greedy)
    assert before.weight_version == "default"
    save_tiny(tmp_path / "seed1", seed=1)
    resp = client.update_weights_from_disk(str(tmp_path / "seed1"), version="v1")
    assert resp.success
    after = client.generate(ids, greedy)
    assert after.weight_version == "v1" and after.cached_tokens == 0  # stale KV was flushed
    assert after.output_ids == hf_greedy(build_tiny_model(1), ids, 16, set())
    assert after.output_ids != before.output_ids
    info = client.model_info()
    assert info.weight_version == "v1" and info.model_path == str(tmp_path / "seed1")


def test_update_weights_from_tensor(client, prompt) -> None:
    ids = prompt("tensors")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    before = client.generate(ids, greedy)
    donor = build_tiny_model(2)
    resp = client.update_weights_from_tensor(dict(donor.named_parameters()), version="v2")
    assert resp.success
    after = client.generate(ids, greedy)
    assert after.weight_version == "v2"
    assert after.output_ids == hf_greedy(donor, ids, 16, set()) != before.output_ids
    # a partial update (one tensor) is allowed and changes outputs again
    layer = {"model.layers.0.mlp.down_proj.weight": build_tiny_model(3).model.layers[0].mlp.down_proj.weight}
    client.update_weights_from_tensor(layer, version="v3")
    assert client.generate(ids, greedy).output_ids != after.output_ids
    assert client.model_info().weight_version == "v3"


def test_bad_weight_updates_are_rejected_without_changing_anything(server, client, prompt, tmp_path: Path) -> None:
    ids = prompt("keep")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = client.generate(ids, greedy).output_ids
    model = build_tiny_model(4)
    bad_shape = {"model.norm.weight": model.model.norm.weight[:3]}
    with pytest.raises(EngineHTTPError) as e:
        client.update_weights_from_tensor(bad_shape, version="bad")
    assert e.value.status == 400 and "serialized_named_tensors" in e.value.body and "model.norm.weight" in e.value.body
    with pytest.raises(EngineHTTPError) as e:
        client.update_weights_from_tensor({"not.a.weight": model.model.norm.weight}, version="bad")
    assert e.value.status == 400
    with pytest.raises(EngineHTTPError) as e:
        client.update_weights_from_disk(str(tmp_path / "missing"), version="bad")
    assert e.value.status == 400 and '"field":"model_path"' in e.value.body.replace(" ", "")
    resp = httpx.post(server.url + "/update_weights_from_tensor", json={"serialized_named_tensors": ["%%%"]})
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "serialized_named_tensors.0"
    assert resp.json()["success"] is False
    assert client.model_info().weight_version == "default"
    assert client.generate(ids, greedy).output_ids == before


def test_client_hanging_up_aborts_its_request(server, prompt) -> None:
    body = {"input_ids": prompt("bye"), "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True}}
    server.engine.scheduler.hold(2)  # the reply cannot end before the server notices the client has left
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json=body, timeout=httpx.Timeout(HANG_S, read=0.3))
    wait_for(lambda: stats(server)["aborted_requests"] == 1 and stats(server)["running"] == 0)
    server.engine.scheduler.release_hold()


def test_closing_a_stream_aborts_its_request(server, client, prompt) -> None:
    server.engine.scheduler.hold(1)  # the reply cannot end before the server notices the stream closed
    stream = client.generate_stream(prompt("stream"), LONG)
    assert len(next(stream).output_ids) == 1
    stream.close()
    wait_for(lambda: stats(server)["aborted_requests"] == 1 and stats(server)["running"] == 0)
    server.engine.scheduler.release_hold()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_crashing_step_fails_requests_loudly_and_marks_engine_unhealthy(server, client, prompt) -> None:
    def boom(batch: object) -> None:
        raise RuntimeError("kaboom")

    server.engine.runner.step = boom  # type: ignore[method-assign]
    r = client.generate(prompt("crash"), SamplingParams(max_new_tokens=4))
    assert r.finish_reason is not None and r.finish_reason.type == "abort"
    assert "kaboom" in (r.finish_reason.message or "")
    assert client.health() is False
    with pytest.raises(EngineHTTPError) as e:
        client.generate(prompt("after"), SamplingParams(max_new_tokens=4))
    assert e.value.status == 503


def test_a_draining_weight_load_finishes_calls_in_flight_on_the_old_weights_and_holds_new_ones(
        server, client, prompt) -> None:
    """A cell that stays in rollout loads each published version: the call in flight finishes (here: is
    aborted) on the weights that began it and reports them; a call arriving meanwhile waits and runs on the
    new weights. No call is served by two versions."""
    engine = server.engine
    client.update_weight_version("0")
    held = engine.scheduler.hold(1)  # "old" runs until aborted below, however slow the machine
    old = Background(server, prompt("old"), LONG, rid="old")
    assert held.wait(HANG_S) and stats(server)["running"] == 1
    tensors = dict(build_tiny_model(seed=1).state_dict())
    loaded: list = []
    load = threading.Thread(target=lambda: loaded.append(engine.load_weights(tensors, version="1", drain=True)))
    load.start()
    wait_for(lambda: stats(server)["draining"])
    new = Background(server, prompt("new"), SamplingParams(temperature=0.0, max_new_tokens=4), rid="new")
    wait_for(lambda: stats(server)["waiting"] == 1)
    assert stats(server)["running"] == 1  # not admitted while the engine drains
    client.abort("old")
    engine.scheduler.release_hold()
    load.join(HANG_S)
    old_result, new_result = old.join(), new.join()
    assert old_result.finish_reason is not None and old_result.finish_reason.type == "abort"
    assert old_result.weight_version == "0" and new_result.weight_version == "1"
    assert loaded[0].num_running == 0 and loaded[0].tensors == len(tensors)
    assert stats(server)["weight_version"] == "1" and not stats(server)["draining"]


def test_a_draining_load_on_an_idle_or_paused_engine_installs_at_once(server, client, prompt) -> None:
    engine = server.engine
    tensors = dict(build_tiny_model(seed=1).state_dict())
    assert engine.load_weights(tensors, version="3", drain=True).num_running == 0
    client.pause("in_place")
    parked = Background(server, prompt("parked"), LONG, rid="parked")
    wait_for(lambda: stats(server)["waiting"] == 1)
    assert engine.load_weights(tensors, version="4", drain=True).tensors == len(tensors)  # paused: no wait
    client.abort("parked")
    assert parked.join().finish_reason.type == "abort"
    assert stats(server)["weight_version"] == "4"


def test_update_weight_version_names_the_weights_without_moving_any(client, prompt) -> None:
    before = client.generate(prompt("hi"), SamplingParams(temperature=0.0, max_new_tokens=4))
    client.update_weight_version("7")
    after = client.generate(prompt("hi"), SamplingParams(temperature=0.0, max_new_tokens=4))
    assert before.weight_version == "default" and after.weight_version == "7"
    assert after.output_ids == before.output_ids
    assert client.model_info().weight_version == "7"
