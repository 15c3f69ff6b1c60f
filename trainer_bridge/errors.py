"""The error a proxy's reply becomes on the trainer side, below both the HTTP client and the fleet
protocol that raise it (``trainer_bridge.client`` re-exports it)."""

from __future__ import annotations


class ProxyError(RuntimeError):
    """The proxy answered with an error (after retries, when the error was transient)."""

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None, code: str | None = None, url: str = ""):
        where = f" ({url})" if url else ""
        super().__init__(f"{message}{where}" if status is None else f"HTTP {status}: {message}{where}")
        self.message = message
        self.status = status
        self.type = type
        self.code = code
        self.url = url
