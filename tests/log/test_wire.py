"""Events cross the wire as the log's own Arrow encoding: everything but seq survives, token lists included."""

from datetime import UTC, datetime

import pytest

from gyre.errors import EventValidationError
from gyre.events import CellLost, ModelCallFinished
from gyre.events.wire import pack_events, unpack_events


def test_events_round_trip_except_seq() -> None:
    ts = datetime(2026, 12, 1, 20, 0, 0, 123456, tzinfo=UTC)
    call = ModelCallFinished(seq=7, ts=ts, run_id="run-1", execution_id="run-1-e0", call_id="k0", cell_id="c0",
                             prompt_delta_ids=[1, 2, 3], output_ids=[4, 5, 6, 7],
                             output_logprobs=[-0.5, -0.25, -1.0, -0.125], policy_version=3, cached_tokens=2,
                             producer="proxy", producer_seq=41)
    lost = CellLost(ts=ts, cell_id="c1", reason="gone", producer="ctl", producer_seq=0)
    back = unpack_events(pack_events([call, lost]))
    assert back == [call.model_copy(update={"seq": None}), lost]
    assert (back[0].ts, back[0].producer, back[0].producer_seq) == (ts, "proxy", 41)
    assert back[0].output_ids == [4, 5, 6, 7] and back[0].output_logprobs == [-0.5, -0.25, -1.0, -0.125]


def test_an_event_without_ts_is_stamped_once_when_packed() -> None:
    data = pack_events([CellLost(cell_id="c0")])
    assert unpack_events(data)[0].ts is not None
    assert unpack_events(data) == unpack_events(data)


def test_empty_and_malformed_batches() -> None:
    assert unpack_events(pack_events([])) == []
    with pytest.raises(EventValidationError, match="not an Arrow IPC stream"):
        unpack_events(b"not arrow")
