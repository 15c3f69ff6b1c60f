"""Store errors; the API layer maps them to HTTP statuses."""


class StoreError(Exception):
    """Base class of store errors."""


class NotFound(StoreError):
    """The named session, turn, response or lease does not exist (HTTP 404)."""


class Conflict(StoreError):
    """The request contradicts what is stored (HTTP 409): a second reward, a duplicate id, an expired lease."""
