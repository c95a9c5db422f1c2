"""SGLang's memory release and resume around training, as the CPU engine serves them."""

import httpx

from gyre.engine import SamplingParams, SyncHttpEngineClient
from gyre.engine.local import LocalEngineServer


def _stats(server: LocalEngineServer) -> dict:
    return httpx.get(server.url + "/gyre/stats").json()


def test_release_frees_the_kv_cache_and_resume_clears_the_tags(server: LocalEngineServer,
                                                                client: SyncHttpEngineClient) -> None:
    client.generate(list(range(3, 40)), SamplingParams(temperature=0.0, max_new_tokens=4))
    assert _stats(server)["cache_tokens"] > 0
    client.release_memory_occupation(["kv_cache"])
    assert _stats(server)["cache_tokens"] == 0 and server.engine.released == {"kv_cache"}
    client.release_memory_occupation()  # no tags: both
    assert server.engine.released == {"kv_cache", "weights"}
    client.resume_memory_occupation(["weights"])
    assert server.engine.released == {"kv_cache"}
    client.resume_memory_occupation()
    assert server.engine.released == set()


def test_unknown_memory_tags_are_refused_naming_the_field(server: LocalEngineServer) -> None:
    response = httpx.post(f"{server.url}/release_memory_occupation", json={"tags": ["gpu"]})
    assert response.status_code == 400 and "tags" in response.text
    assert server.engine.released == set()
