"""The event vocabulary, its Arrow schema and the codec between the two."""

from gyre.events.codec import check_events, decode, encode, parse_event, validate_batch
from gyre.events.models import *  # noqa: F403 - the vocabulary is the package's public surface
from gyre.events.models import ENVELOPE_FIELDS, EVENT_TYPES, Event, event_type
from gyre.events.schema import SCHEMA_VERSION, event_schema, evolve, payload_type, schema_json

__all__ = [
    "ENVELOPE_FIELDS",
    "EVENT_TYPES",
    "SCHEMA_VERSION",
    "Event",
    "check_events",
    "decode",
    "encode",
    "event_schema",
    "event_type",
    "evolve",
    "parse_event",
    "payload_type",
    "schema_json",
    "validate_batch",
]
