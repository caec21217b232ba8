"""The one error type of the data pipelines: what was wrong, where (source, row, field) and why."""

from __future__ import annotations

from typing import Any


class DataError(ValueError):
    """Bad input data. ``str(err)`` reads ``"FILE:ROW field 'images[1]': truncated PNG (...)"``.

    ``source`` is the file (or dataset) name, ``row`` the 1-based line for JSONL/CSV and the 0-based
    record index for JSON arrays, Parquet and ``datasets`` (``"FILE:ROW"`` inside a folder source);
    ``field`` the column or field (with an index for list items); ``reason`` the human-readable cause;
    ``category`` a short key (``"truncated image"``, ``"missing field"`` ...)
    under which a skipping reader counts the record.
    """

    def __init__(
        self,
        reason: str,
        *,
        category: str = "bad record",
        source: Any = None,
        row: int | str | None = None,
        field: str | None = None,
    ) -> None:
        self.reason, self.category = reason, category
        self.source = None if source is None else str(source)
        self.row, self.field = row, field
        super().__init__(self._message())

    def _message(self) -> str:
        where = self.source or ""
        if self.row is not None:
            where = f"{where}:{self.row}"
        if self.field is not None:
            where = f"{where} field '{self.field}'" if where else f"field '{self.field}'"
        return f"{where}: {self.reason}" if where else self.reason

    def located(self, *, source: Any = None, row: int | str | None = None, field: str | None = None) -> DataError:
        """Fill in the location parts that are still unknown (in place) and return self."""
        if self.source is None and source is not None:
            self.source = str(source)
        if self.row is None:
            self.row = row
        if self.field is None:
            self.field = field
        self.args = (self._message(),)
        return self

    def __str__(self) -> str:
        return self._message()

    def __reduce__(self):  # picklable across worker processes
        return _rebuild, (self.reason, self.category, self.source, self.row, self.field)


def _rebuild(reason, category, source, row, field) -> DataError:
    return DataError(reason, category=category, source=source, row=row, field=field)
