"""Requests captured from the real Codex CLI (tests/fixtures/codex/codex-session.json, recorded once through the
proxy by `python -m tests.harness.codex_session`), replayed through the proxy: each gets a 200 with the items
Codex got when it was recorded, every echo of the model's calls renders to exactly what it wrote, and the
hosted web search Codex offers is left out and recorded."""

from __future__ import annotations

import json

import httpx

from tests.harness.codex_session import FIXTURE, requests_of
from tests.proxy.proxy_helpers import TOKEN


def test_codex_cli_session_replays_through_the_proxy(scripted, start_proxy) -> None:
    data = json.loads(FIXTURE.read_text())
    bodies = requests_of(data)
    assert len(bodies) == 4 and all(b["stream"] for b in bodies)
    kinds = {t["type"] for t in bodies[0]["tools"]}
    assert {"function", "custom", "namespace", "web_search"} <= kinds  # what makes the session worth replaying
    p = start_proxy({"cell0": scripted.url})
    scripted.say(*[e["reply"] for e in data["exchanges"]])
    for body, entry in zip(bodies, data["exchanges"], strict=True):
        response = httpx.post(f"{p.url}/v1/responses", json=body, timeout=60,
                              headers={"authorization": f"Bearer {TOKEN}", "accept": "text/event-stream"})
        assert response.status_code == 200, response.text
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "response.completed"
        shapes = [{k: i[k] for k in ("type", "name", "namespace", "input", "arguments", "role") if k in i}
                  for i in events[-1]["response"]["output"]]
        assert shapes == entry["output"]
    started, finished = p.events("model_call_started"), p.events("model_call_finished")
    assert [e.dropped_tools for e in started] == [["web_search"]] * 4
    assert [e.parent_call_id for e in finished[1:]] == [e.call_id for e in finished[:-1]]  # one growing turn
    assert all(e.drift_tokens == 0 for e in finished)  # Codex's echoes render to what the model wrote
