"""TITO exactness: over a 20-turn conversation (alternating APIs), the ids the log records are, token for
token, the ids the engine received and produced — reassembled from the log with DuckDB alone."""

from __future__ import annotations

import anthropic
import openai

from gyre.log import LogReader
from tests.proxy.proxy_helpers import TOKEN

REASSEMBLE = """
WITH RECURSIVE seqs(call_id, prompt, full_seq) AS (
    SELECT call_id, prompt_delta_ids, list_concat(prompt_delta_ids, output_ids)
    FROM model_calls WHERE parent_call_id IS NULL
  UNION ALL
    SELECT c.call_id,
           list_concat(list_slice(s.full_seq, 1, c.prefix_len), c.prompt_delta_ids),
           list_concat(list_concat(list_slice(s.full_seq, 1, c.prefix_len), c.prompt_delta_ids), c.output_ids)
    FROM model_calls c JOIN seqs s ON c.parent_call_id = s.call_id
)
SELECT s.call_id, s.prompt, m.output_ids, m.output_logprobs, m.parent_call_id, m.drift_tokens
FROM seqs s JOIN model_calls m USING (call_id) ORDER BY m.seq
"""


def test_twenty_turns_reassemble_exactly_from_the_log(engine_server, engine_capture, start_proxy) -> None:
    p = start_proxy({"cell0": engine_server.url}, log=True)
    oa = openai.OpenAI(base_url=f"{p.url}/v1", api_key=TOKEN, max_retries=0, timeout=30)
    an = anthropic.Anthropic(base_url=p.url, api_key=TOKEN, max_retries=0, timeout=30)
    system = "You are a coding agent."
    history: list[tuple[str, str]] = []  # (role, text): API-neutral
    for turn in range(20):
        history.append(("user", f"step {turn}: run the tests"))
        if turn % 2 == 0:
            reply = oa.chat.completions.create(
                model="m",
                max_tokens=6,
                seed=turn,
                messages=[{"role": "system", "content": system}, *({"role": r, "content": t} for r, t in history)],
            )
            text = reply.choices[0].message.content or ""
        else:
            message = an.messages.create(
                model="c", max_tokens=6, system=system, messages=[{"role": r, "content": t} for r, t in history]
            )
            text = "".join(b.text for b in message.content if b.type == "text")
        history.append(("assistant", text))
    p.server.stop()
    p.sink.close()

    rows = LogReader(p.log_dir).duckdb().execute(REASSEMBLE).fetchall()
    assert len(rows) == 20
    for index, (call_id, prompt, output, logprobs, parent, _drift) in enumerate(rows):
        engine = engine_capture[f"{call_id}#0"]
        assert prompt == engine.input_ids, f"turn {index}: recorded prompt differs from what the engine got"
        assert output == engine.output_ids, f"turn {index}: recorded output differs from what the engine sampled"
        assert [round(x, 4) for x in logprobs] == [round(x, 4) for x in engine.output_logprobs]
        assert (parent is None) == (index == 0), "every turn extends the previous call"
        if index:
            assert parent == rows[index - 1][0]
