"""What the proxy imposes on every call's sampling: an emulated run's ``ignore_eos`` (every call generates its
whole max_tokens, as the scenario's output counts say), and nothing of the kind otherwise."""

from __future__ import annotations

import openai
import pytest

from gyre.proxy.config import SamplingOverrides
from tests.proxy.proxy_helpers import TOKEN


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_ignore_eos_reaches_the_engine_only_when_imposed(scripted, start_proxy, ignore_eos: bool) -> None:
    p = start_proxy({"cell0": scripted.url}, sampling=SamplingOverrides(ignore_eos=ignore_eos))
    scripted.say("ok")
    client = openai.OpenAI(base_url=p.url + "/v1", api_key=TOKEN, max_retries=0, timeout=30)
    client.chat.completions.create(model="m", max_tokens=7, messages=[{"role": "user", "content": "hi"}])
    params = scripted.requests[0]["sampling_params"]
    assert params.get("ignore_eos", False) is ignore_eos and params["max_new_tokens"] == 7
