"""``splice bench images``: what screenshots cost Splice, stored and per turn.

A computer-use agent sends a new screenshot every turn and re-sends the whole history (every
earlier screenshot, base64 in the JSON) on every call. One session of ``--turns`` such turns goes
through ``splice serve`` in front of the zero-latency SGLang stand-in (its own process; it expands
each image to the processor's placeholder count as SGLang does), next to a text-only twin with
the same words. Reported per turn: the client's wall time for the image session and the text
twin, the difference, and that difference per image the request carried; and the bytes the store
holds per image-turn (the image table, and the whole database file against the twin's).
Screenshots are synthetic UI frames (``--width`` x ``--height``), PNG, different every turn.
"""

from __future__ import annotations

import base64
import io
import json
import os
import statistics
import tempfile
import time


def add_parser(sub) -> None:
    p = sub.add_parser("images", help="bytes stored per image-turn and added latency per image, first and later turns")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--max-pixels", type=int, default=12845056, help="the image processor's max_pixels (Qwen2.5-VL's default)")
    p.add_argument("--reps", type=int, default=3, help="sessions per variant (new screenshots each); the best turn time is kept")
    p.add_argument("--out", help="results JSON (default bench_images.json)")


def screenshot(k: int, width: int, height: int) -> bytes:
    """A synthetic UI frame: title bar, sidebar, text lines, a moving cursor; PNG."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (width, height), (246, 247, 249))
    d = ImageDraw.Draw(im)
    d.rectangle([0, 0, width, 36], fill=(52, 58, 70))
    d.rectangle([0, 36, 220, height], fill=(231, 234, 238))
    for i in range(24):
        y = 60 + i * 26
        d.text((240, y), f"row {i} of turn {k}: status ok, value {(k * 37 + i * 11) % 997}", fill=(30, 30, 30))
        d.text((16, y), f"item {i}", fill=(80, 80, 90))
    x, y = 300 + (k * 97) % (width - 340), 80 + (k * 53) % (height - 120)
    d.rectangle([x, y, x + 120, y + 32], outline=(20, 110, 220), width=2, fill=(220, 235, 252))
    d.text((x + 10, y + 10), f"Button {k}", fill=(20, 60, 140))
    buf = io.BytesIO()
    im.save(buf, "PNG", optimize=True)
    return buf.getvalue()


def _session(url: str, sid: str, frames: list[bytes] | None, turns: int) -> list[float]:
    import httpx

    msgs: list[dict] = []
    times = []
    with httpx.Client(timeout=120) as c:
        for k in range(turns):
            text = f"Step {k}: here is the screen. What do you click next?"
            if frames is None:
                msgs.append({"role": "user", "content": text})
            else:
                url_k = "data:image/png;base64," + base64.b64encode(frames[k]).decode()
                msgs.append({"role": "user", "content": [{"type": "text", "text": text},
                                                          {"type": "image_url", "image_url": {"url": url_k}}]})  # fmt: skip
            body = json.dumps({"model": "m", "messages": msgs, "max_tokens": 64}).encode()
            t0 = time.perf_counter()
            r = c.post(url + "/v1/chat/completions", content=body,
                       headers={"content-type": "application/json", "X-Session-Id": sid})  # fmt: skip
            times.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise SystemExit(f"turn {k} of {sid}: {r.status_code} {r.text[:300]}")
            m = r.json()["choices"][0]["message"]
            msgs.append({"role": "assistant", "content": m.get("content"), "tool_calls": m.get("tool_calls")})
    return times


def _serve(tmp: str, folder: str, n_tokens: int, procs: list) -> str:
    from engines.reference.launch import free_port  # noqa: F401 - stack uses it
    from tokenization import load_tokenizer

    from .stack import REPLY_TEXT, start_splice, start_standin, wait_http

    tok = load_tokenizer(folder)
    out_ids = tok.encode(REPLY_TEXT, add_special_tokens=False)
    engine = start_standin(tmp, tok, out_ids, procs, image_tokens=n_tokens)
    port = start_splice(tmp, engine, folder, procs, renderer="generic")
    url = f"http://127.0.0.1:{port}"
    if why := wait_http(url + "/health", procs[-1], timeout=120):
        raise SystemExit(f"splice serve: {why}")
    return url


def run(args) -> dict:
    from engines.reference.vision_files import write_vision_processor_files
    from tokenization import load_tokenizer
    from tokenization.vision import VisionSpec

    from ..store import Store
    from .stack import stop_all

    # every session its own screenshots: each turn's new image is decoded for the first time
    frames = {r: [screenshot(1000 * r + k, args.width, args.height) for k in range(args.turns)] for r in range(-1, args.reps)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(write_vision_processor_files(os.path.join(tmp, "vl"), max_pixels=args.max_pixels))
        spec = VisionSpec.from_model_dir(folder, load_tokenizer(folder))
        grid = spec.grid(args.width, args.height)
        n_tokens = spec.n_tokens(grid)
        results: dict = {}
        for name, fr in (("text", None), ("images", frames)):
            pick = (lambda r: None) if fr is None else (lambda r, fr=fr: fr[r])
            procs: list = []
            work = os.path.join(tmp, name)
            os.makedirs(work)
            try:
                url = _serve(work, folder, n_tokens, procs)
                _session(url, f"warm-{name}", pick(-1), 1)  # warm-up (imports, first render)
                runs = [_session(url, f"{name}-{r}", pick(r), args.turns) for r in range(args.reps)]
            finally:
                stop_all(procs)
            results[name] = [min(col) for col in zip(*runs)]
            with Store(os.path.join(work, "splice.sqlite")) as st:
                results[name + "_store"] = {**st.images.stats(), "db_bytes": os.path.getsize(os.path.join(work, "splice.sqlite"))}
    png = [len(f) for r in range(args.reps) for f in frames[r]]
    added = [i - t for i, t in zip(results["images"], results["text"])]
    per_image = [a / (k + 1) for k, a in enumerate(added)]
    sessions = args.reps + 1
    image_turns = args.turns * args.reps + 1
    st_i, st_t = results["images_store"], results["text_store"]
    return {
        "width": args.width, "height": args.height, "grid_thw": list(grid), "tokens_per_image": n_tokens,
        "png_bytes_mean": statistics.mean(png), "turns": args.turns, "reps": args.reps,
        "text_s": results["text"], "images_s": results["images"], "added_s": added, "added_per_image_s": per_image,
        "stored_images": st_i["images"], "sent_images": sum(range(1, args.turns + 1)) * args.reps + 1,
        "decoded_first_time": image_turns,
        "image_table_bytes": st_i["image_bytes"], "image_turns": image_turns, "sessions": sessions,
        "db_bytes_images": st_i["db_bytes"], "db_bytes_text": st_t["db_bytes"],
        "bytes_per_image_turn": (st_i["db_bytes"] - st_t["db_bytes"]) / image_turns,
        "history_image_s": (added[-1] - added[0]) / max(1, args.turns - 1),
    }


def print_table(res: dict) -> None:
    print(f"screenshots {res['width']}x{res['height']} PNG (mean {res['png_bytes_mean'] / 1e3:.1f} kB), grid "
          f"{res['grid_thw']} -> {res['tokens_per_image']} placeholder tokens each; {res['turns']} turns, best of {res['reps']}")
    print()
    print("| turn | images sent | text twin ms | with images ms | added ms | added ms per image sent |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k in range(res["turns"]):
        print(f"| {k} | {k + 1} | {res['text_s'][k] * 1e3:.1f} | {res['images_s'][k] * 1e3:.1f} | "
              f"{res['added_s'][k] * 1e3:.1f} | {res['added_per_image_s'][k] * 1e3:.2f} |")
    print()
    print(f"first turn: +{res['added_s'][0] * 1e3:.1f} ms for its one new image (base64, decode, hash, render, store); "
          f"each re-sent history image: +{res['history_image_s'] * 1e3:.2f} ms (slope over the later turns; never decoded again)")
    print(f"store: {res['sent_images']} images sent, {res['stored_images']} rows ({res['image_table_bytes'] / 1e3:.0f} kB of PNG); "
          f"database {res['db_bytes_images'] / 1e6:.2f} MB vs {res['db_bytes_text'] / 1e6:.2f} MB for the text twin: "
          f"{res['bytes_per_image_turn'] / 1e3:.1f} kB per image-turn")
