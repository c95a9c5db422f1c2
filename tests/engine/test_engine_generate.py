"""The local engine over HTTP: log-probs, greedy equivalence, prefix cache, batching, stops, streaming."""

from __future__ import annotations

import math
import threading

import httpx
import pytest
import torch
from engine_helpers import hf_greedy, hf_logits, wait_for

from gyre.engine import GenerateResult, SamplingParams, SyncHttpEngineClient
from gyre.engine.local import LocalEngineServer
from tests.conftest import HANG_S

EOS = {258, 256}


def stats(server: LocalEngineServer) -> dict:
    return httpx.get(server.url + "/gyre/stats").json()


def test_logprobs_equal_plain_forward_pass_at_temperature_one(client, prompt, ref_model) -> None:
    ids = prompt("write a poem")
    r = client.generate(ids, SamplingParams(max_new_tokens=24, sampling_seed=1, ignore_eos=True))
    assert r.finish_reason is not None and r.finish_reason.type == "length"
    assert len(r.output_ids) == len(r.output_logprobs) == r.completion_tokens == 24
    logits = hf_logits(ref_model, ids + r.output_ids)
    raw = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
    expected = raw[torch.arange(24), torch.tensor(r.output_ids)]
    assert torch.allclose(torch.tensor(r.output_logprobs), expected, atol=1e-4)


def filtered_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The documented rule for one row: temperature, then top-k, then the smallest top-p nucleus."""
    x = logits / temperature
    x = torch.where(x >= torch.topk(x, top_k).values[-1], x, torch.tensor(-math.inf))
    p = torch.softmax(x, -1)
    order = torch.argsort(p, descending=True)
    before = torch.cumsum(p[order], 0) - p[order]
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order[before < top_p]] = True
    return torch.log_softmax(torch.where(keep, x, torch.tensor(-math.inf)), -1)


def test_logprobs_follow_the_sampled_distribution_with_filters(client, prompt, ref_model) -> None:
    ids = prompt("filtered")
    params = SamplingParams(max_new_tokens=24, temperature=0.7, top_k=40, top_p=0.9, sampling_seed=5, ignore_eos=True)
    r = client.generate(ids, params)
    logits = hf_logits(ref_model, ids + r.output_ids)
    for i, (tok_id, lp) in enumerate(zip(r.output_ids, r.output_logprobs, strict=True)):
        expected = filtered_logprobs(logits[len(ids) - 1 + i], 0.7, 40, 0.9)
        assert expected[tok_id] > -math.inf, "sampled a token outside the filtered support"
        assert abs(lp - float(expected[tok_id])) < 1e-4


def test_greedy_equals_plain_hf_greedy_loop(client, prompt, ref_model) -> None:
    ids = prompt("hello there")
    r = client.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=32))
    assert r.output_ids == hf_greedy(ref_model, ids, 32, EOS)
    assert r.output_logprobs == [0.0] * len(r.output_ids)  # a point mass: log 1


def test_seeded_sampling_is_reproducible(client, prompt) -> None:
    ids = prompt("seeded")
    p = SamplingParams(max_new_tokens=16, sampling_seed=11, ignore_eos=True)
    a, b = client.generate(ids, p), client.generate(ids, p)
    c = client.generate(ids, SamplingParams(max_new_tokens=16, sampling_seed=12, ignore_eos=True))
    assert b.cached_tokens > 0  # the rerun takes the cached path; float noise only, same tokens
    assert a.output_ids == b.output_ids
    assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5)
    assert a.output_ids != c.output_ids


def test_prefix_cache_computes_only_new_tokens(server, client, prompt) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    first_ids = prompt("turn one")
    first = client.generate(first_ids, greedy)
    assert first.cached_tokens == 0
    second_ids = first_ids + first.output_ids + prompt("turn two")
    before = stats(server)["forward_tokens"]
    second = client.generate(second_ids, greedy)
    computed = stats(server)["forward_tokens"] - before
    reused = len(first_ids) + len(first.output_ids) - 1  # the last sampled token never had KV
    assert second.cached_tokens == reused
    assert computed == len(second_ids) - reused + len(second.output_ids) - 1
    client.flush_cache()
    uncached = client.generate(second_ids, greedy)
    assert uncached.cached_tokens == 0
    assert uncached.output_ids == second.output_ids


def test_identical_prompt_reuses_all_but_last_token(client, prompt) -> None:
    ids = prompt("again")
    p = SamplingParams(temperature=0.0, max_new_tokens=4)
    a = client.generate(ids, p)
    b = client.generate(ids, p)
    assert b.cached_tokens == len(ids) - 1
    assert a.output_ids == b.output_ids


def test_concurrent_requests_are_batched_and_match_solo_runs(server, client, prompt, ref_model) -> None:
    prompts = [prompt(f"request number {i}") for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    results: dict[int, GenerateResult] = {}

    def run(i: int) -> None:
        with SyncHttpEngineClient(server.url) as c:
            results[i] = c.generate(prompts[i], greedy)

    client.pause("in_place")  # hold admission so all 8 enter the same step
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    wait_for(lambda: stats(server)["waiting"] == 8)
    client.resume()
    for t in threads:
        t.join(HANG_S)
    assert sorted(results) == list(range(8))
    assert stats(server)["max_batch_size"] == 8
    for i in (0, 7):
        assert results[i].output_ids == hf_greedy(ref_model, prompts[i], 12, set())
    client.flush_cache()
    for i in range(8):
        assert client.generate(prompts[i], greedy).output_ids == results[i].output_ids


def test_stop_token_ids_and_stop_strings(client, prompt) -> None:
    ids = prompt("stops")
    base = client.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)).output_ids
    stop_tok = base[5]
    r = client.generate(
        ids, SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True, stop_token_ids=[stop_tok])
    )
    cut = base.index(stop_tok)
    assert r.finish_reason is not None and r.finish_reason.type == "stop" and r.finish_reason.matched == stop_tok
    assert r.output_ids == base[: cut + 1]  # the stop token is kept in output_ids (it was sampled)

    j = next(i for i, t in enumerate(base) if 33 <= t < 127)  # a printable ASCII byte
    stop = chr(base[j])
    r = client.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True, stop=[stop]))
    assert r.finish_reason is not None and r.finish_reason.matched == stop
    assert r.output_ids == base[: j + 1]
    assert stop not in (r.text or "")
    kept = client.generate(
        ids, SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True, stop=stop, no_stop_trim=True)
    )
    assert (kept.text or "").endswith(stop)


def test_streaming_is_cumulative_and_ends_like_non_streaming(client, prompt) -> None:
    ids = prompt("stream me")
    p = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    chunks = list(client.generate_stream(ids, p))
    assert [len(c.output_ids) for c in chunks] == list(range(1, 11))
    assert all(c.finish_reason is None for c in chunks[:-1])
    final = client.generate(ids, p)
    assert chunks[-1].output_ids == final.output_ids and chunks[-1].finish_reason == final.finish_reason


def test_batch_and_text_inputs(server, prompt, tok) -> None:
    a, b = prompt("a"), prompt("b")
    p = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    batch = httpx.post(server.url + "/generate", json={"input_ids": [a, b], "sampling_params": p}).json()
    single = httpx.post(server.url + "/generate", json={"input_ids": b, "sampling_params": p}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[1]["output_ids"] == single["output_ids"]
    text = httpx.post(server.url + "/generate", json={"text": tok.decode(b), "sampling_params": p}).json()
    assert text["output_ids"] == single["output_ids"]
    assert single["meta_info"]["prompt_tokens"] == len(b)
    assert "output_token_logprobs" not in single["meta_info"]  # only with return_logprob


def test_max_new_tokens_zero(client, prompt) -> None:
    r = client.generate(prompt("nothing"), SamplingParams(max_new_tokens=0))
    assert r.output_ids == [] and r.finish_reason is not None and r.finish_reason.type == "length"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"sampling_params": {}}, "body"),
        ({"input_ids": [1, 2], "text": "x"}, "body"),
        ({"input_ids": [1, "a"]}, "input_ids.1"),
        ({"input_ids": [1, 99999]}, "input_ids"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 1.0}}, "sampling_params.frequency_penalty"),
        ({"input_ids": [1], "bogus": 1}, "bogus"),
        ({"input_ids": [[1], [2]], "rid": ["only-one"]}, "rid"),
        ({"input_ids": [[1], [2, 99999]]}, "input_ids.1"),
        ({"text": ""}, "text"),
    ],
)
def test_bad_requests_get_400_naming_the_field(server, body, field) -> None:
    resp = httpx.post(server.url + "/generate", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["field"] == field


def test_invalid_json_and_bad_admin_bodies(server) -> None:
    resp = httpx.post(server.url + "/generate", content=b"{nope")
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "body"
    resp = httpx.post(server.url + "/pause_generation", json={"mode": "sideways"})
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "mode"
    resp = httpx.post(server.url + "/abort_request", json={})
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "rid"
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_duplicate_rid_in_flight_is_rejected(server, client, prompt) -> None:
    client.pause("in_place")
    body = {"input_ids": prompt("dup"), "rid": "same", "sampling_params": {"max_new_tokens": 2}}
    first = threading.Thread(target=lambda: httpx.post(server.url + "/generate", json=body, timeout=HANG_S))
    first.start()
    wait_for(lambda: stats(server)["waiting"] == 1)
    resp = httpx.post(server.url + "/generate", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "rid"
    client.resume()
    first.join(HANG_S)
