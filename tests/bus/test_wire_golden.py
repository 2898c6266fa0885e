"""The wire format is a protocol: these bytes may only change together with WIRE_VERSION.

Regenerate (only when bumping WIRE_VERSION): python tests/bus/test_wire_golden.py --regenerate
"""

import sys
from pathlib import Path

import pytest

from llmbus.bus import messages as m
from llmbus.testing.wire_samples import SAMPLES

FIXTURES = Path(__file__).parents[1] / "fixtures" / "wire"


def fixture_path(kind: m.Kind) -> Path:
    return FIXTURES / f"v{m.WIRE_VERSION}-{kind.value:02x}-{kind.name.lower()}.bin"


def test_every_kind_has_a_sample():
    assert set(SAMPLES) == set(m.Kind)


@pytest.mark.parametrize("kind", list(m.Kind), ids=lambda k: k.name)
def test_golden_bytes(kind):
    frames = m.encode(SAMPLES[kind])
    assert frames[0] == bytes([kind.value])
    golden = fixture_path(kind).read_bytes()
    assert frames[0] + frames[1] == golden, f"{kind.name} encodes differently: bump WIRE_VERSION"
    assert m.decode([golden[:1], golden[1:]]) == SAMPLES[kind]


def test_missing_trailing_fields_take_defaults():
    # An older sender omits fields added later: the receiver fills defaults.
    full = m.encode(SAMPLES[m.Kind.STEP_RESULT])
    import msgpack
    values = msgpack.unpackb(full[1])[:4]
    msg = m.decode([full[0], msgpack.packb(values)])
    assert msg.forward_time == 0.0 and msg.top_tokens == []


OLDER_FIXTURES = [path for version in range(1, m.WIRE_VERSION) for path in sorted(FIXTURES.glob(f"v{version}-*.bin"))]


@pytest.mark.parametrize("path", OLDER_FIXTURES, ids=lambda p: p.stem)
def test_older_versions_still_decode(path):
    # Versions 2 to 6 only appended fields with defaults (and added kinds): what an older sender wrote must still parse.
    golden = path.read_bytes()
    version = int(path.name[1:path.name.index("-")])
    msg = m.decode([golden[:1], golden[1:]])
    if isinstance(msg, m.StepCommand):
        assert all(new.cached_ids == [] or version >= 2 for new in msg.new_requests)
        assert all(new.grammar is None or version >= 5 for new in msg.new_requests)
        assert all(new.sampling.presence_penalty == 0.0 or version >= 3 for new in msg.new_requests)
        assert all(new.sampling.min_p == 0.0 or version >= 9 for new in msg.new_requests)
        assert all(new.adapter == "" or version >= 15 for new in msg.new_requests)
        assert all(new.images == [] or version >= 23 for new in msg.new_requests)
    if isinstance(msg, m.AddRequest):
        assert msg.sampling.presence_penalty == 0.0 or version >= 3
        assert msg.sampling.min_p == 0.0 or version >= 9
        assert msg.traceparent == "" or version >= 4
        assert msg.grammar is None or version >= 5
        assert msg.adapter == "" or version >= 15
        assert msg.images == [] or version >= 23
    if isinstance(msg, m.FrontendStats):
        assert msg.adapter_names == [] or version >= 16
    if isinstance(msg, m.SchedulerStats) and version == 1:
        assert msg.kv_blocks_cached == 0 and msg.prefill_forward is None


@pytest.mark.parametrize("frames", [
    [b"\x01"],
    [b"\x01\x02", b"\x90"],
    [b"\xee", b"\x90"],
    [b"\x01", b"\xc1garbage"],
    [b"\x01", b"\x90"],  # AddRequest without its required fields
    [b"\x02", b"\x81\xa1a\x01"],  # a map where an array is due
])
def test_malformed_frames_raise_protocol_error(frames):
    with pytest.raises(m.ProtocolError):
        m.decode(frames)


if __name__ == "__main__" and "--regenerate" in sys.argv:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for kind, msg in SAMPLES.items():
        kind_frame, payload = m.encode(msg)
        fixture_path(kind).write_bytes(kind_frame + payload)
    print(f"wrote {len(SAMPLES)} fixtures to {FIXTURES}")


def _with(kind: m.Kind, index: int, value) -> list[bytes]:
    import msgpack

    values = SAMPLES[kind].to_wire()
    values[index] = value
    return [bytes([kind.value]), msgpack.packb(values)]


@pytest.mark.parametrize("kind,index,value", [
    (m.Kind.ADD_REQUEST, 2, ["x"]),  # input_ids
    (m.Kind.ADD_REQUEST, 2, [True]),  # a bool is not a token id
    (m.Kind.ADD_REQUEST, 2, 5),
    (m.Kind.ADD_REQUEST, 3, [1.0, "hot"]),  # sampling.temperature, nested
    (m.Kind.ADD_REQUEST, 4, [None]),  # stopping.max_new_tokens is required and an int
    (m.Kind.ADD_REQUEST, 8, ["json_schema", 7]),  # grammar.source
    (m.Kind.ABORT_REQUEST, 0, [1, 2]),  # rids are strings
    (m.Kind.HEALTH_CHECK, 2, "soon"),
    (m.Kind.STEP, 5, [1, None]),  # token_ids
    (m.Kind.TOKEN_BATCH, 3, [0, 1.5]),  # finish_reasons
    (m.Kind.FRONTEND_HELLO, 0, None),
])
def test_wrong_field_types_raise_protocol_error(kind, index, value):
    with pytest.raises(m.ProtocolError, match=r"\."):
        m.decode(_with(kind, index, value))


def test_floats_may_arrive_as_integers_and_optional_fields_as_nil():
    assert m.decode(_with(m.Kind.HEALTH_CHECK, 2, 5)).timeout_s == 5
    assert m.decode(_with(m.Kind.ADD_REQUEST, 8, None)).grammar is None
