"""One engine replica as the pool sees it (``Replica``), its stable id, and merging the replicas'
facts into the pool's (``merge_info``). Plain data and pure functions; ``engines.pool`` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass

from engines.client import EngineClient
from engines.types import EngineInfo


@dataclass
class Replica:
    """One engine replica and what the pool knows about it."""

    url: str
    client: EngineClient
    healthy: bool = True
    stale: bool = False  # missed a weight update: not routed to until it has the current weights
    in_flight: int = 0
    info: EngineInfo | None = None  # what the replica said at start(); None if it was down
    version: int | None = None  # the weight version the engine last reported (None: unknown)
    reports_version: bool = True  # False once a vLLM replica showed it has no /weight_info
    # Why the replica takes no traffic at all: a weight transfer to it began and has not
    # completed (its weights may be part old, part new). Lifted by a complete publish: the
    # engine then reports ``target_version``.
    out_of_rotation: str | None = None
    target_version: int | None = None
    # The transfer that took it out: when this proxy last heard of it (begin, join, a bucket;
    # time.monotonic()), and whether its weights may have started changing (a join or a bucket
    # was issued, or a commit listed it as failed). None: no transfer pending.
    transfer_seen: float | None = None
    transfer_touched: bool = False
    epoch: int = 0  # bumped each time the replica comes back after being down (it may have restarted)

    @property
    def usable(self) -> bool:
        return self.healthy and not self.stale and self.out_of_rotation is None

    @property
    def id(self) -> str:
        """A stable identity for the engine behind this replica: its URL (credentials redacted),
        scheme and host lower-cased, no trailing slash. Proxies that name an engine the same way
        report the same id, which is how a fleet publish loads each engine once."""
        return engine_id(self.url)


def engine_id(url: str) -> str:
    """``Replica.id`` for a URL (see there)."""
    import urllib.parse

    url = url.strip().rstrip("/")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    netloc = f"{userinfo}{at}{hostport.lower()}"
    return urllib.parse.urlunsplit((parts.scheme.lower(), netloc, parts.path.rstrip("/"), parts.query, ""))


def back_in_rotation(r: Replica) -> None:
    """The replica's weights are whole again: no pending transfer keeps it out of traffic."""
    r.out_of_rotation = r.target_version = r.transfer_seen = None
    r.transfer_touched = False


def agreed_version(versions: list[int | None]) -> int | None:
    """The version every replica that reports one reports (None: none, or they disagree)."""
    known = {v for v in versions if v is not None}
    return known.pop() if len(known) == 1 else None


def merge_info(infos: list[EngineInfo | None], urls: list[str]) -> EngineInfo:
    """One ``EngineInfo`` for the pool from each replica's (None: the replica did not answer)."""
    known = [(u, i) for u, i in zip(urls, infos) if i is not None]
    if not known:
        return EngineInfo(warnings=("no engine replica answered at start-up: engine facts unknown",))
    warnings: list[str] = [w for _, i in known for w in i.warnings]
    contexts = [i.context_length for _, i in known if i.context_length is not None]
    if len(set(contexts)) > 1:
        warnings.append(f"replicas report different context lengths {sorted(set(contexts))}: using the smallest")
    served = [i.served_model for _, i in known if i.served_model]
    if len(set(served)) > 1:
        warnings.append(f"replicas serve different models {sorted(set(served))}")
    versions = [i.weight_version for _, i in known]
    version = versions[0] if len(set(versions)) == 1 else None
    if len(set(versions)) > 1:
        warnings.append(f"replicas report different weight versions {versions}")
    ties = [i.tied_lm_head for _, i in known if i.tied_lm_head is not None]
    return EngineInfo(
        context_length=min(contexts) if contexts else None,
        model_path=next((i.model_path for _, i in known if i.model_path), None),
        served_model=served[0] if served else None,
        weight_version=version,
        can_pause=all(i.can_pause for _, i in known),
        can_reload=all(i.can_reload for _, i in known),
        tied_lm_head=(True in ties) if ties else None,
        worker_extension=all(i.worker_extension for _, i in known),
        warnings=tuple(warnings),
    )
