"""The results file of a sweep: one row per point, streamed as points finish, resumable.

The extension picks the format: `.csv` (a header line, then one line per row) or `.jsonl` /
`.ndjson` (one JSON object per line). Each row is one whole line, written with a single
`os.write` on an append-only descriptor and then fsync'ed, so a stopped sweep leaves whole rows
only. A hard kill in the middle of that write can leave one partial last line; `ResultsFile.open`
cuts it off before appending, and its point is planned again.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
from enum import StrEnum
from pathlib import Path

try:
    import fcntl
except ImportError:  # no flock (Windows): a second sweep on one results file is not refused
    fcntl = None

from planner.errors import invalid
from planner.sweeps.spec import POINT_KEYS, SweepPoint


class PointStatus(StrEnum):
    OK = "ok"                  # a plan was found
    INFEASIBLE = "infeasible"  # nothing fits (or the solver gave up); `reason` says what would
    INVALID = "invalid"        # bad input for this point (batch not divisible, model fails to trace, ...)
    ERROR = "error"            # an unexpected exception; `reason` holds its type and message


class ResultsFormat(StrEnum):
    CSV = "csv"
    JSONL = "jsonl"


SUFFIX_FORMATS = {".csv": ResultsFormat.CSV, ".jsonl": ResultsFormat.JSONL, ".ndjson": ResultsFormat.JSONL}

# Every row has exactly these columns (None where they do not apply, e.g. the plan of a failed
# point); the first four are the point, the row's key.
COLUMN_TYPES: dict[str, type] = {
    "model": str, "cluster": str, "global_batch": int, "seq_len": int,
    "settings": str, "device": str, "devices": int, "nodes": int,
    "status": str, "reason": str,
    "config": str, "dp": int, "tp": int, "pp": int, "cp": int, "ep": int, "vpp": int,
    "micro_batch": int, "num_microbatches": int, "zero": int, "recompute": str, "schedule": str,
    "step_time_s": float, "tokens_per_s": float, "tflops_per_gpu": float, "mfu": float,
    "peak_memory_bytes": float, "capacity_bytes": float,
    "cluster_usd_per_hour": float, "usd_per_million_tokens": float,
    "plan_time_s": float, "plan_path": str,
    "dp_replicate": int, "host_bytes": float, "fingerprint": str, "notes": str,
}
COLUMNS = tuple(COLUMN_TYPES)
# Columns added after the first results files were written, in the order they came: a file whose
# columns stop before some of them reads with those empty, and is rewritten with every column
# before a sweep appends to it.
ADDED_COLUMNS = ("dp_replicate", "host_bytes", "fingerprint", "notes")


def results_format(path: str | Path, what: str = "--out") -> ResultsFormat:
    """The format of a results file, from its extension; `what` names the file in errors.

    Raises:
        PlannerError: INVALID_INPUT for any other extension.
    """
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIX_FORMATS:
        raise invalid(f"{what} {path}: unknown results extension {suffix!r}; use .csv or .jsonl")
    return SUFFIX_FORMATS[suffix]


def row_point(row: dict) -> SweepPoint:
    """The point a row belongs to."""
    return SweepPoint(*(row[key] for key in POINT_KEYS))


# The fix for a file that is not a sweep's results, whichever command read it.
NOT_RESULTS_FIX = "give a results file `paraplan sweep` wrote (a sweep: write to a new --out file)"


def rows_without_plan(rows: list[dict], plan_dir: str | Path) -> int:
    """How many of the planned rows (status ok) have no plan file in `plan_dir`: rows planned by
    a run without `--plan-dir`, or with another one, that a resumed run does not plan again."""
    folder = Path(plan_dir).resolve()
    return sum(row["status"] == PointStatus.OK and not (row["plan_path"] and Path(row["plan_path"]).resolve().parent == folder
                                                        and Path(row["plan_path"]).is_file())
               for row in rows)


def read_results(path: str | Path) -> list[dict]:
    """The rows of a results file, typed (int, float, str; None where empty).

    A partial last line (from a hard kill mid-write) is ignored. A point written more than once (two
    sweeps appending to one file, files joined) counts once: its last row, in its first row's place.

    Raises:
        PlannerError: INVALID_INPUT when the file is missing or is not a paraplan results file.
    """
    path = Path(path)
    if path.is_dir():
        raise invalid(f"results file {path}: is a directory; {NOT_RESULTS_FIX}")
    if not path.is_file():
        raise invalid(f"results file {path}: not found; check the path")
    rows, _ = _parse(path, results_format(path, "results file"), _whole_lines(path.read_bytes()))
    return list({row_point(row): row for row in rows}.values())


class ResultsFile:
    """An open results file: the rows already in it, and appending new ones whole.

    Use `ResultsFile.open(path)`, as a context manager.
    """

    def __init__(self, path: Path, rows: list[dict], fd: int, lock: int | None = None):
        self.path = path
        self.format = results_format(path)
        self.rows = rows
        self._fd = fd
        self._lock = lock

    @classmethod
    def open(cls, path: str | Path) -> "ResultsFile":
        """Open (or create) `path` for appending, after reading its rows and cutting off a partial last line.

        Raises:
            PlannerError: another process has the file open (two sweeps would both plan every point).
        """
        path = Path(path)
        fmt = results_format(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = _locked(path)
        rows: list[dict] = []
        current = True
        if path.exists():
            data = path.read_bytes()
            whole = _whole_lines(data)
            rows, current = _parse(path, fmt, whole)
            if len(whole) != len(data):
                os.truncate(path, len(whole))
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        results = cls(path, rows, fd, lock)
        if not current:
            results.rewrite(rows)
        elif fmt == ResultsFormat.CSV and os.fstat(fd).st_size == 0:
            results._write(_csv_line(COLUMNS))
        return results

    def append(self, row: dict) -> None:
        """Write one row as one whole line and push it to disk."""
        self._write(encode_row(row, self.format))
        self.rows.append(row)

    def rewrite(self, rows: list[dict]) -> None:
        """Replace the file's content by `rows` atomically (a temporary file renamed over it)."""
        temporary = self.path.with_name(self.path.name + ".tmp")
        header = _csv_line(COLUMNS) if self.format == ResultsFormat.CSV else ""
        temporary.write_text(header + "".join(encode_row(row, self.format) for row in rows))
        os.replace(temporary, self.path)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.rows = list(rows)

    def close(self) -> None:
        os.close(self._fd)
        if self._lock is not None:
            os.close(self._lock)  # releases the lock; the empty lock file stays (removing it would race)

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, line: str) -> None:
        os.write(self._fd, line.encode())
        os.fsync(self._fd)


def _locked(path: Path) -> int | None:
    """A descriptor holding an exclusive lock for writing `path` (None where the platform has no flock)."""
    if fcntl is None:
        return None
    lock = os.open(path.with_name(f".{path.name}.lock"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise invalid(f"{path}: another sweep is writing it now; wait for it to end or write to another --out") from None
    return lock


def encode_row(row: dict, fmt: ResultsFormat) -> str:
    """One row as one line of `fmt`, newline included; strings lose any line breaks."""
    values = [_one_line(row.get(column)) for column in COLUMNS]
    if fmt == ResultsFormat.CSV:
        return _csv_line(values)
    return json.dumps(dict(zip(COLUMNS, values))) + "\n"


def _one_line(value):
    return " ".join(value.splitlines()) if isinstance(value, str) else value


def _csv_line(values) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(["" if v is None else v for v in values])
    return buffer.getvalue()


def _whole_lines(data: bytes) -> bytes:
    return data[: data.rfind(b"\n") + 1]


def _parse(path: Path, fmt: ResultsFormat, data: bytes) -> tuple[list[dict], bool]:
    """The typed rows, and whether they have every column (False: a file from before `ADDED_COLUMNS`)."""
    try:
        lines = data.decode().splitlines()
    except UnicodeDecodeError as error:
        raise invalid(f"{path}: not a text file (byte {error.start} is not UTF-8); give a sweep's .csv or .jsonl results") from None
    if fmt == ResultsFormat.JSONL:
        rows = [_checked(path, number, _typed_json(path, number, line)) for number, line in enumerate(lines, 1) if line.strip()]
        return [{**dict.fromkeys(ADDED_COLUMNS), **row} for row in rows], all(len(row) == len(COLUMNS) for row in rows)
    if not lines:
        return [], True
    reader = csv.reader(lines)
    header = tuple(next(reader))
    if header != COLUMNS[:len(header)] or not set(COLUMNS[len(header):]) <= set(ADDED_COLUMNS):
        raise invalid(f"{path}:1: the header is not this paraplan's sweep columns; {NOT_RESULTS_FIX}")
    rows = []
    for number, values in enumerate(reader, 2):
        if len(values) != len(header):
            raise invalid(f"{path}:{number}: {len(values)} values for {len(header)} columns; the file is damaged, fix or remove that line")
        row = dict.fromkeys(ADDED_COLUMNS)
        row.update({column: _typed(path, number, column, text) for column, text in zip(header, values)})
        rows.append(_checked(path, number, {column: row[column] for column in COLUMNS}))
    return rows, header == COLUMNS


# What a row of each status must carry: the point and its hardware, and for a plan the figures a
# report reads.
_POINT_COLUMNS = ("model", "cluster", "global_batch", "seq_len", "settings", "device", "devices")
_PLAN_COLUMNS = ("config", "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes")


def _checked(path: Path, number: int, row: dict) -> dict:
    """`row`, once it has a known status and the values that status needs."""
    if row.get("status") not in set(PointStatus):
        raise invalid(f"{path}:{number}: status={row.get('status')!r}: expected one of {', '.join(PointStatus)}; "
                      f"the file is damaged, fix or remove that line")
    needed = _POINT_COLUMNS + (_PLAN_COLUMNS if row["status"] == PointStatus.OK else ())
    missing = next((column for column in needed if row.get(column) is None), None)
    if missing:
        raise invalid(f"{path}:{number}: {missing} is empty in a row of status {row['status']}; "
                      f"the file is damaged, fix or remove that line")
    infinite = next((column for column, value in row.items() if isinstance(value, float) and not math.isfinite(value)), None)
    if infinite:
        raise invalid(f"{path}:{number}: {infinite}={row[infinite]}: not a finite number; the file is damaged, fix or "
                      f"remove that line")
    return row


def _typed(path: Path, number: int, column: str, text: str):
    if text == "":
        return None
    try:
        return COLUMN_TYPES[column](text)
    except ValueError:
        raise invalid(f"{path}:{number}: {column}={text!r}: expected {COLUMN_TYPES[column].__name__}") from None


def _typed_json(path: Path, number: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise invalid(f"{path}:{number}: not a JSON object ({error.msg}); the file is damaged, fix or remove that line") from None
    if not isinstance(row, dict) or not (set(COLUMNS) - set(ADDED_COLUMNS) <= set(row) <= set(COLUMNS)):
        raise invalid(f"{path}:{number}: the keys are not this paraplan's sweep columns; {NOT_RESULTS_FIX}")
    return {column: row[column] for column in COLUMNS if column in row}
