"""The event vocabulary: one schema, checked-in JSON in sync, strict validation, lossless codec."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.errors import EventValidationError, UnknownEventKindError
from gyre.events import EVENT_TYPES, decode, encode, event_schema, parse_event, schema_json, validate_batch
from gyre.events.models import ModelCallFinished, RewardRecorded, RoleSwitchRequested

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE_KINDS = (
    "run_started", "run_finished", "cell_registered", "cell_lost", "role_switch_requested",
    "role_switch_completed", "execution_queued", "execution_started", "execution_finished",
    "model_call_started", "model_call_finished", "call_redirected", "reward_recorded", "evaluation_failed",
    "train_step_started", "micro_step_claimed", "micro_step_finished", "train_step_finished",
    "weights_published", "satellite_joined", "satellite_left",
)


def test_checked_in_schema_matches_the_code() -> None:
    path = ROOT / "schemas" / "events.v1.json"
    assert path.read_text() == schema_json(), "schemas/events.v1.json is stale: run `gyre schema dump`"


def test_every_architecture_kind_has_a_model_and_a_struct_column() -> None:
    schema = event_schema()
    for kind in ARCHITECTURE_KINDS:
        assert kind in EVENT_TYPES
        assert pa.types.is_struct(schema.field(kind).type)
    assert schema.field("seq").type == pa.int64() and not schema.field("seq").nullable
    assert str(schema.field("ts").type) == "timestamp[us, tz=UTC]"
    payload = schema.field("model_call_finished").type
    assert payload.field("output_ids").type == pa.list_(pa.int32())
    assert payload.field("output_logprobs").type == pa.list_(pa.float32())
    document = json.loads(schema_json())
    assert set(document["kinds"]) == set(EVENT_TYPES)


def test_parse_event_names_what_is_wrong() -> None:
    with pytest.raises(UnknownEventKindError, match="unknown event kind 'model_cal'"):
        parse_event({"kind": "model_cal", "execution_id": "e"})
    with pytest.raises(EventValidationError, match="missing the required field 'kind'"):
        parse_event({"execution_id": "e"})
    with pytest.raises(EventValidationError, match=r"reward_recorded.*execution_id: Field required"):
        parse_event({"kind": "reward_recorded", "reward": 0.5})
    with pytest.raises(EventValidationError, match=r"reward.*less than or equal to 1"):
        parse_event({"kind": "reward_recorded", "execution_id": "e", "reward": 3})
    with pytest.raises(EventValidationError, match=r"output_ids\.0"):
        parse_event({"kind": "model_call_finished", "execution_id": "e", "call_id": "c", "cell_id": "x",
                     "output_ids": ["a"], "output_logprobs": [0.0]})
    with pytest.raises(EventValidationError, match="must match one to one"):
        parse_event({"kind": "model_call_finished", "execution_id": "e", "call_id": "c", "cell_id": "x",
                     "output_ids": [1, 2], "output_logprobs": [0.0]})
    with pytest.raises(EventValidationError, match="Extra inputs are not permitted"):
        parse_event({"kind": "reward_recorded", "execution_id": "e", "reward": 0.1, "bonus": 1})


token_lists = st.lists(st.integers(0, 2**31 - 1), max_size=20)


@st.composite
def model_calls(draw: st.DrawFn) -> ModelCallFinished:
    outputs = draw(token_lists)
    parent = draw(st.none() | st.text(min_size=1, max_size=5))
    return ModelCallFinished(
        execution_id=draw(st.text(min_size=1, max_size=8)), call_id=draw(st.text(min_size=1, max_size=8)),
        cell_id="c", parent_call_id=parent, prefix_len=draw(st.integers(0, 100)) if parent else 0,
        prompt_delta_ids=draw(token_lists), output_ids=outputs,
        output_logprobs=[float(np.float32(-i / 7)) for i in range(len(outputs))],
        branch=draw(st.sampled_from(["main", "main-summary", "sub-agent", "sub-agent-summary"])))


events_strategy = st.lists(
    st.one_of(
        model_calls(),
        st.builds(RewardRecorded, execution_id=st.text(min_size=1, max_size=8), reward=st.floats(0, 1)),
        st.builds(RoleSwitchRequested, cell_id=st.just("c1"), from_role=st.just("rollout"),
                  to_role=st.just("training"), watermark=st.none() | st.integers(0, 10)),
    ),
    min_size=1, max_size=30)


@given(events_strategy)
@settings(max_examples=60, deadline=None)
def test_encode_decode_round_trip(events: list) -> None:
    batch = encode(events, first_seq=100, stamps_us=1_700_000_000_000_000)
    back = list(decode(batch))
    assert [e.seq for e in back] == list(range(100, 100 + len(events)))
    for original, decoded in zip(events, back, strict=True):
        assert decoded.model_dump(exclude={"seq", "ts"}) == original.model_dump(exclude={"seq", "ts"})
    # Sparse: only the kinds present are stored.
    assert set(batch.schema.names) - {"seq", "ts", "kind", "run_id", "execution_id", "call_id", "cell_id",
                                      "step", "producer", "producer_seq"} == {e.kind for e in events}


def test_validate_batch_refuses_bad_columns_with_their_names() -> None:
    good = encode([RewardRecorded(execution_id="e", reward=0.5)], 0).drop_columns(["seq", "ts"])
    assert validate_batch(good).num_rows == 1
    with pytest.raises(EventValidationError, match=r"\['bogus'\]"):
        validate_batch(good.append_column("bogus", pa.array([1])))
    with pytest.raises(EventValidationError, match="'seq'"):
        validate_batch(encode([RewardRecorded(execution_id="e", reward=0.5)], 0))
    with pytest.raises(EventValidationError, match="envelope field 'execution_id'"):
        validate_batch(good.set_column(good.schema.get_field_index("execution_id"), "execution_id",
                                       pa.array([None], pa.string())))
    with pytest.raises(UnknownEventKindError):
        validate_batch(good.set_column(good.schema.get_field_index("kind"), "kind", pa.array(["nope"])))
    wrong = pa.RecordBatch.from_pydict({"kind": ["reward_recorded"], "execution_id": ["e"],
                                        "reward_recorded": pa.array([{"reward": "high"}])})
    with pytest.raises(EventValidationError, match="column 'reward_recorded'"):
        validate_batch(wrong)
    missing_payload = pa.RecordBatch.from_pydict({"kind": ["reward_recorded"], "execution_id": ["e"]})
    with pytest.raises(EventValidationError, match="payload column 'reward_recorded'"):
        validate_batch(missing_payload)


@given(events_strategy, st.booleans(), st.booleans())
@settings(max_examples=40, deadline=None)
def test_small_and_large_batch_encodings_agree(events: list, own_ts: bool, per_event_stamps: bool) -> None:
    """The row-wise encoding of small batches (the proxy's) is the columnar one, schema and values."""
    from datetime import UTC, datetime, timedelta

    from gyre.events.codec import _encode_columns, _encode_rows

    if own_ts:  # every other event keeps its own time; the rest take the writer's stamp
        start = datetime(2026, 1, 1, tzinfo=UTC)
        events = [e.model_copy(update={"ts": start + timedelta(microseconds=7 * i)}) if i % 2 else e
                  for i, e in enumerate(events)]
    stamps = [1_700_000_000_000_000 + i for i in range(len(events))] if per_event_stamps else 1_700_000_000_000_000
    rows = _encode_rows(events, 5, stamps, "run-x")
    columns = _encode_columns(events, 5, stamps, "run-x")
    assert rows.schema.equals(columns.schema, check_metadata=True)
    assert rows.to_pylist() == columns.to_pylist()
