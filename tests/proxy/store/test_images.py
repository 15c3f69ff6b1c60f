"""Images in the store: bytes once per content hash however many turns show them, each turn's
image references round-trip, samples carry the last turn's references (JSON, Arrow, schema),
and ``GET /v1/images/{hash}`` serves the bytes behind the admin token."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
from jsonschema import Draft202012Validator
from PIL import Image

from proxy.store import ImageRef, Store, StoredImage
from proxy.store.columns import ipc_stream
from proxy.store.samples import assemble_samples
from tests.proxy.api.samples_fixture import _turn, serve

SCHEMA = json.loads((Path(__file__).parents[3] / "proxy" / "schemas" / "sample.schema.json").read_text())


def png(color: tuple[int, int, int], size=(30, 20)) -> StoredImage:
    im = Image.new("RGB", size, color)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    h = hashlib.sha256(f"RGB:{size[0]}x{size[1]}:".encode() + im.tobytes()).hexdigest()
    return StoredImage(h, "image/png", size[0], size[1], (1, 2, 2), buf.getvalue())


def _with_images(turn, refs):
    turn.images = tuple(refs)
    return turn


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "s.db"))
    yield s
    s.close()


def test_an_image_shown_by_every_turn_is_stored_once(store):
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    r0 = ImageRef(red.hash, 2, 1, red.grid_thw)
    r1 = ImageRef(blue.hash, 9, 1, blue.grid_thw)
    store.sessions.upsert("a")
    # turn 0: [.., vs, pad, ve, ..]; turn 1 splices onto it and adds a second image
    store.turns.add(_with_images(_turn("a", 0, [1, 151652, 151655, 151653, 5], [10, 11], [-0.5, -1.0], [0, 0]), [r0]),
                    new_images=[red])  # fmt: skip
    p1 = [1, 151652, 151655, 151653, 5, 10, 11, 7, 151652, 151655, 151653, 8]
    store.turns.add(_with_images(_turn("a", 1, p1, [12], [-0.25], [0]), [r0, r1]), new_images=[red, blue])
    stats = store.images.stats()
    assert stats == {"images": 2, "image_bytes": len(red.data) + len(blue.data), "turns_with_images": 2}
    turns = store.turns.list("a")
    assert [t.images for t in turns] == [(r0,), (r0, r1)]
    assert store.images.refs_of("a-t1") == (r0, r1) and store.images.refs_of("nope") == ()
    got = store.images.get(blue.hash)
    assert got == blue and Image.open(io.BytesIO(got.data)).getpixel((0, 0)) == (0, 0, 255)
    # samples: the sample's images are its last turn's, offsets in the sample's own tokens
    store.sessions.set_reward("a", 1.0)
    with store.db.read() as c:
        samples = assemble_samples(store.sessions.get("a"), store.turns.iter_tokens(c, "a"))
    assert len(samples) == 1
    s = samples[0]
    assert [r.to_dict() for r in s.images] == [
        {"hash": red.hash, "offset": 2, "length": 1, "grid_thw": [1, 2, 2]},
        {"hash": blue.hash, "offset": 9, "length": 1, "grid_thw": [1, 2, 2]},
    ]
    for r in s.images:  # each reference points at its placeholder in the sample's ids
        assert s.input_ids[r.offset] == 151655 and s.input_ids[r.offset - 1] == 151652
    Draft202012Validator(SCHEMA).validate({"schema_version": 3, "lease_id": None, "dropped_stale": 0,
                                           "samples": [json.loads(json.dumps(s.to_dict()))]})  # fmt: skip
    table = pa.ipc.open_stream(b"".join(ipc_stream(samples))).read_all()
    assert table.column("images").to_pylist()[0] == [r.to_dict() for r in s.images]


def test_a_text_turn_has_no_image_rows(store):
    store.sessions.upsert("t")
    store.turns.add(_turn("t", 0, [1, 2], [3], [-1.0], [0]))
    assert store.turns.list("t")[0].images == () and store.images.stats()["turns_with_images"] == 0


def test_a_failed_turn_commit_stores_no_image(store):
    red = png((255, 0, 0))
    store.sessions.upsert("c")
    store.sessions.set_reward("c", 0.0)  # closed: the next turn is refused
    with pytest.raises(Exception):
        store.turns.add(_with_images(_turn("c", 0, [151652, 151655, 151653], [1], [-1.0], [0]),
                                     [ImageRef(red.hash, 1, 1, red.grid_thw)]), new_images=[red])  # fmt: skip
    assert store.images.stats()["images"] == 0 and store.images.get(red.hash) is None


def test_image_route_serves_bytes_behind_the_admin_token(store):
    red = png((255, 0, 0))
    store.sessions.upsert("a")
    store.turns.add(_with_images(_turn("a", 0, [151652, 151655, 151653], [1], [-1.0], [0]),
                                 [ImageRef(red.hash, 1, 1, red.grid_thw)]), new_images=[red])  # fmt: skip
    with serve(store) as url:
        r = httpx.get(f"{url}/v1/images/{red.hash}")
        assert r.status_code == 200 and r.content == red.data and r.headers["content-type"] == "image/png"
        assert r.headers["x-splice-image-grid"] == "1,2,2" and "immutable" in r.headers["cache-control"]
        missing = httpx.get(f"{url}/v1/images/{'0' * 64}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "image_not_found"
        bad = httpx.get(f"{url}/v1/images/not-a-hash")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "image_hash"


def test_image_route_needs_the_admin_token():
    from proxy.auth import Access, access_of, check
    from proxy.errors import APIError

    assert access_of("/v1/images/" + "a" * 64) is Access.TRAINER
    with pytest.raises(APIError) as e:  # the agent key does not open it once an admin token is set
        check("/v1/images/" + "a" * 64, "Bearer agent-key", api_key="agent-key", admin_token="admin")
    assert e.value.status == 401
    check("/v1/images/" + "a" * 64, "Bearer admin", api_key="agent-key", admin_token="admin")
