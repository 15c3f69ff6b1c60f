"""``splice export``: training samples to Parquet files, one row per sample, for offline analysis
and for trainers that read datasets (``datasets.load_dataset("parquet", data_files=...)``).

Columns are the sample schema's (docs/samples.md): ids and versions ``list<int32>``, logprobs
``list<float32>``, mask ``list<uint8>``, per-turn spans ``list<struct>``. Reads either a running
proxy (``--proxy URL``: ``GET /v1/trajectories/samples``, Arrow) or a store file directly
(``--store FILE``). Nothing is leased or acked unless ``--consume`` asks for it: then samples are
pulled like a trainer pulls them and each lease is acked once its file is complete.

Each page (or lease) becomes one file, written under a temporary name and renamed when
complete, so a directory never holds a half-written file. Memory: one record batch at a time
from a store file; one answer (a page of sessions, or a lease) at a time from a proxy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .store.columns import ARROW_STREAM, chunks, schema
from .store.samples import SAMPLE_SCHEMA_VERSION

PAGE_SESSIONS = 200


def parse_since(value: str | None) -> float | None:
    """Unix seconds, or an ISO 8601 date/time (UTC unless it says otherwise)."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--since: expected unix seconds or an ISO 8601 time, got {value!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


class ParquetDir:
    """Numbered Parquet files in one directory, each complete before it appears."""

    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.n = len(list(out.glob("samples-*.parquet")))
        self.rows = 0
        self.files: list[Path] = []

    def write(self, batches: Iterator[pa.RecordBatch]) -> int:
        """One file from ``batches``; returns its rows (no file when there are none)."""
        path = self.out / f"samples-{self.n:05d}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        writer = None
        rows = 0
        try:
            for batch in batches:
                if batch.num_rows == 0:  # nothing to write: no file holding only a schema
                    continue
                if writer is None:
                    writer = pq.ParquetWriter(tmp, schema(), compression="zstd")
                writer.write_batch(batch)
                rows += batch.num_rows
        finally:
            if writer is not None:
                writer.close()
        if writer is None:
            return 0
        os.replace(tmp, path)
        self.n += 1
        self.rows += rows
        self.files.append(path)
        return rows


def _check_version(version: str | None, where: str) -> None:
    if version != str(SAMPLE_SCHEMA_VERSION):
        raise SystemExit(
            f"{where} sent sample schema version {version!r}; this export writes version {SAMPLE_SCHEMA_VERSION} "
            "(docs/samples.md): run a matching splice"
        )


def _read_stream(content: bytes, where: str) -> tuple[dict[str, str], list[pa.RecordBatch]]:
    reader = pa.ipc.open_stream(content)
    meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    _check_version(meta.get("splice.schema_version"), where)
    return meta, list(reader)


def _check_is_store(path: str) -> None:
    """Refuse a file that is not a splice store before ``Store`` opens it (which would create
    the schema in it: an empty or foreign file is never written to)."""
    import sqlite3
    import urllib.parse

    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
    try:
        con = sqlite3.connect(uri, uri=True)
        try:
            names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        raise SystemExit(f"{path} is not a splice store ({exc})") from None
    if not {"sessions", "turns"} <= names:
        raise SystemExit(f"{path} is not a splice store (no sessions / turns tables)")


def export_store(path: str, out: Path, *, since: float | None, acked: bool) -> ParquetDir:
    from .store import Store

    if not Path(path).is_file():
        raise SystemExit(f"no store file at {path}")
    _check_is_store(path)
    files = ParquetDir(out)
    with Store(path) as store:
        after = None
        while True:
            rows = store.pool.rewarded(since=since, acked=acked, after=after, limit=PAGE_SESSIONS)
            if not rows:
                break
            files.write(chunks(store.pool.samples([sid for _, sid in rows])))
            after = rows[-1]
    return files


def _error_message(r) -> str:
    """The message of an OpenAI-shaped error body, on one line."""
    try:
        message = r.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - not our error shape
        message = r.text
    return " ".join(str(message).split())[:300]


def export_proxy(url: str, out: Path, *, since: float | None, acked: bool, consume: bool, admin_token: str | None,
                 max_samples: int = 256, timeout_s: float = 600.0) -> ParquetDir:
    import httpx

    headers = {"Accept": ARROW_STREAM}
    if admin_token:
        headers["Authorization"] = f"Bearer {admin_token}"
    files = ParquetDir(out)
    base = url.rstrip("/")
    with httpx.Client(base_url=base, headers=headers, timeout=timeout_s) as http:

        def answer(r: httpx.Response) -> tuple[dict[str, str], list[pa.RecordBatch]]:
            if r.is_error:
                raise SystemExit(f"{r.request.method} {r.request.url.path}: HTTP {r.status_code}: {_error_message(r)}")
            if r.headers.get("content-type", "").split(";")[0] != ARROW_STREAM:
                raise SystemExit(f"{base} did not answer an Arrow stream (content-type {r.headers.get('content-type')!r})")
            return _read_stream(r.content, base)

        if consume:
            while True:
                meta, batches = answer(http.post("/v1/trajectories/pull", json={"max_samples": max_samples, "wait_s": 0}))
                lease = meta.get("splice.lease_id")
                if lease is None:
                    break
                files.write(iter(batches))  # complete on disk before the lease is acked
                ack = http.post("/v1/trajectories/ack", json={"lease_id": lease})
                if ack.is_error:
                    raise SystemExit(f"ack of {lease} failed: HTTP {ack.status_code}: {_error_message(ack)}")
            return files
        cursor = None
        while True:
            params: dict[str, str] = {"limit": str(PAGE_SESSIONS), "acked": "true" if acked else "false"}
            if since is not None:
                params["since"] = repr(since)
            if cursor:
                params["cursor"] = cursor
            meta, batches = answer(http.get("/v1/trajectories/samples", params=params))
            files.write(iter(batches))
            cursor = meta.get("splice.next_cursor")
            if not cursor:
                break
    return files


class ExportError(Exception):
    """A failure the user can act on: reported as one line, exit status 2."""


def _local_admin_token(url: str) -> str | None:
    """The token a ``splice serve`` on this machine generated, for a loopback ``--proxy``."""
    import urllib.parse

    from .auth import TokenFileError, admin_token_file, is_loopback_host, read_token_file

    if not is_loopback_host(urllib.parse.urlsplit(url).hostname or ""):
        return None
    try:
        return read_token_file(admin_token_file())
    except TokenFileError:
        return None


def main(argv: list[str] | None = None) -> int:
    """Errors (no store, an unreachable or refusing proxy, a file that is not a store, an output
    directory that cannot be written) are one line on stderr and exit status 2."""
    import sqlite3

    import httpx

    try:
        return _main(argv)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            raise  # argparse (usage errors already printed) or a plain exit
        print(f"splice export: {exc.code}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"splice export: cannot reach the proxy: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except sqlite3.Error as exc:
        print(f"splice export: cannot read the store: {exc} (is it a splice store file?)", file=sys.stderr)
        return 2
    except pa.ArrowException as exc:
        print(f"splice export: the answer is not a readable Arrow stream: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"splice export: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="splice export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--proxy", metavar="URL", help="a running proxy (reads GET /v1/trajectories/samples)")
    src.add_argument("--store", metavar="FILE", help="a proxy's SQLite store file")
    ap.add_argument("--out", metavar="DIR", required=True, help="directory for samples-NNNNN.parquet")
    ap.add_argument("--since", type=parse_since, metavar="TIME", help="only sessions rewarded at or after TIME (unix s or ISO 8601)")
    ap.add_argument("--acked", action="store_true", help="also sessions the trainer already acked (default: not yet acked)")
    ap.add_argument("--consume", action="store_true", help="with --proxy: pull and ack like a trainer (samples are then gone from the pool)")
    ap.add_argument("--admin-token", default=os.environ.get("SPLICE_ADMIN_TOKEN") or None,
                    help="the proxy's admin token (default: env SPLICE_ADMIN_TOKEN, else, for a proxy on this machine, "
                         "the token splice serve generated in $SPLICE_HOME/admin_token)")
    args = ap.parse_args(argv)
    if args.consume and not args.proxy:
        ap.error("--consume needs --proxy (a store file is read without leasing)")
    if args.consume and (args.acked or args.since is not None):
        ap.error("--consume hands out what the trainer would get next; --acked and --since do not apply")
    out = Path(args.out)
    if args.store:
        files = export_store(args.store, out, since=args.since, acked=args.acked)
    else:
        token = args.admin_token or _local_admin_token(args.proxy)
        files = export_proxy(args.proxy, out, since=args.since, acked=args.acked, consume=args.consume, admin_token=token)
    print(f"wrote {files.rows} samples in {len(files.files)} file(s) under {out}", file=sys.stderr)
    return 0
