"""Peak proxy memory for N concurrent worst-case images: ``python -m proxy.bench.image_memory``.

Each configuration runs in a fresh process: N requests, each carrying one image at the pixel
limit (a single-colour PNG: a small file that decodes to ``--pixels`` pixels), converted at once
through the proxy's own image path (``ImageInput.prepare``, the decode cache, the decode slots);
the table shows the process's peak RSS (``VmHWM``) above its RSS before the first decode, and
the RSS still held afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import subprocess
import sys
import time


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _child(n: int, concurrency: int, pixels: int) -> dict:
    from PIL import Image

    from engines.reference.vision_files import write_vision_processor_files
    from proxy.api.images import ImageInput
    from proxy.settings import Settings
    from tokenization.vision import VisionSpec
    import tempfile

    side = int(math.isqrt(pixels))
    shots = []
    for i in range(n):  # distinct colours: no cache hits
        buf = io.BytesIO()
        Image.new("RGB", (side, side), (i * 37 % 256, 90, 200)).save(buf, format="PNG")
        shots.append(buf.getvalue())
    import base64

    urls = ["data:image/png;base64," + base64.b64encode(s).decode() for s in shots]
    spec = VisionSpec.from_model_dir(write_vision_processor_files(tempfile.mkdtemp()))
    images = ImageInput.from_settings(Settings(image_decode_concurrency=concurrency, max_image_pixels=side * side), spec)

    async def run():
        bodies = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}}]}]} for u in urls]
        return await asyncio.gather(*(images.prepare(b) for b in bodies))

    import gc

    gc.collect()
    try:  # start the peak (VmHWM) from here: making the test images is not the proxy's cost
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    reqs = asyncio.run(run())
    took = time.perf_counter() - t0
    assert all(isinstance(v, object) for r in reqs for v in r.resolved.values())
    del reqs
    gc.collect()
    return {"n": n, "concurrency": concurrency, "pixels": side * side, "png_kb": len(shots[0]) // 1024,
            "peak_mb": (_status_kb("VmHWM") - before) / 1024, "held_mb": (_status_kb("VmRSS") - before) / 1024, "s": took}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m proxy.bench.image_memory", description=__doc__)
    ap.add_argument("--n", type=int, default=4, help="concurrent requests, one worst-case image each")
    ap.add_argument("--pixels", type=int, default=50_000_000, help="pixels per image (the --max-image-pixels default)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4], help="--image-decode-concurrency values")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.n, a.concurrency[0], a.pixels)))
        return 0
    print("| requests at once | --image-decode-concurrency | image | PNG KiB | peak RSS above start, MB | held after, MB | seconds |")
    print("|---|---|---|---|---|---|---|")
    for c in a.concurrency:
        out = subprocess.run([sys.executable, "-m", "proxy.bench.image_memory", "--child", "--n", str(a.n), "--pixels", str(a.pixels),
                              "--concurrency", str(c)], capture_output=True, text=True, check=True)  # fmt: skip
        r = json.loads(out.stdout.strip().splitlines()[-1])
        side = int(math.isqrt(r["pixels"]))
        print(f"| {r['n']} | {c} | {side}x{side} | {r['png_kb']} | {r['peak_mb']:.0f} | {r['held_mb']:.0f} | {r['s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
