"""Where hardware profiles live: the profile roots, the names they hold, and reading one file (a
profile, or an op table a device profile names).

A profile is named (case-insensitive) after its file under `devices/`, `links/` or `clusters/` of a
root in `profile_dirs()`, the first match winning, or given as a `.yaml`/`.json` path. Errors are
one-line `ProfileError`s that name the nearest known names.
"""
from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import yaml

from costmodel.op_table import OpTable
from costmodel.errors import ProfileError
from costmodel.strict_parse import load_text

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
PROFILES_PATH_ENV = "PARAPLAN_PROFILES_PATH"
PROFILE_SUFFIXES = (".yaml", ".yml", ".json")
SHORTHAND_EXAMPLE = "h100-sxm:16x8"
# An op table `paraplan profile` writes beside its device file, which names it in `op_tables`: not a
# profile itself, so listings skip it.
OP_TABLE_MARK = "-ops-"


def profile_dirs() -> tuple[Path, ...]:
    """Profile roots searched for names, first match wins.

    Returns:
        The directories of PARAPLAN_PROFILES_PATH (os.pathsep-separated), then PROFILES_DIR. Each
        root may hold `devices/`, `links/` and `clusters/`.
    """
    extra = os.environ.get(PROFILES_PATH_ENV, "")
    return tuple(Path(p).expanduser() for p in extra.split(os.pathsep) if p) + (PROFILES_DIR,)


def list_devices() -> list[str]:
    """Names of the device profiles found in `profile_dirs()`, sorted."""
    return list_names("devices", profile_dirs())


def list_links() -> list[str]:
    """Names of the link profiles found in `profile_dirs()`, sorted."""
    return list_names("links", profile_dirs())


def list_clusters() -> list[str]:
    """Names of the cluster profiles found in `profile_dirs()`, sorted."""
    return list_names("clusters", profile_dirs())


def nearest_names(name: str, candidates: list[str], limit: int = 3) -> list[str]:
    """Candidates that start with `name`, then the closest others by difflib, at most `limit`."""
    prefixed = [c for c in candidates if name and c.startswith(name)]
    similar = difflib.get_close_matches(name, candidates, n=limit, cutoff=0.5)
    return (prefixed + [c for c in similar if c not in prefixed])[:limit]


def list_names(kind_dir: str, dirs: tuple[Path, ...]) -> list[str]:
    """Names of the profiles under `kind_dir` ("devices", "links", "clusters") of `dirs`, sorted."""
    return sorted({p.stem for d in dirs if (d / kind_dir).is_dir()
                   for p in (d / kind_dir).iterdir() if p.suffix in PROFILE_SUFFIXES and not is_op_table_name(p)})


def op_table_name(stem: str, dtype: str) -> str:
    """The file name of the op table of `dtype` beside the profile `stem`."""
    return f"{stem}{OP_TABLE_MARK}{dtype}.json"


def is_op_table_name(path: Path) -> bool:
    """Whether `path` is named as `op_table_name` names op tables."""
    stem, mark, dtype = path.stem.rpartition(OP_TABLE_MARK)
    return bool(stem and mark and dtype) and path.suffix == ".json"


def looks_like_path(text: str) -> bool:
    """Whether `text` names a file (a profile suffix or a directory separator) rather than a profile."""
    return text.lower().endswith(PROFILE_SUFFIXES) or "/" in text or os.sep in text


def is_file(path: Path) -> bool:
    """Path.is_file that answers False for names the OS rejects (too long, NUL bytes)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def is_dir(path: Path) -> bool:
    """Path.is_dir that answers False for names the OS rejects."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def resolve(kind_dir: str, what: str, name_or_path: str | Path, dirs: tuple[Path, ...]) -> Path:
    """Find the file behind a profile name or path, or raise naming the nearest known names."""
    if isinstance(name_or_path, Path) or looks_like_path(name_or_path):
        try:
            path = Path(name_or_path).expanduser()
        except RuntimeError:  # "~user" naming no known user: not a path we can open
            raise ProfileError(f"{what} file {str(name_or_path)!r}: not found; check the path") from None
        if not is_file(path):
            problem = "a folder, not a profile file" if is_dir(path) else "not found; check the path"
            raise ProfileError(f"{what} file {str(name_or_path)!r}: {problem}")
        return path
    name = name_or_path.strip().lower()
    for root in dirs:
        for suffix in PROFILE_SUFFIXES:
            candidate = root / kind_dir / f"{name}{suffix}"
            if is_file(candidate):
                return candidate
    known = list_names(kind_dir, dirs)
    close = nearest_names(name, known)
    hint = f"did you mean {', '.join(close)}" if close else f"known: {', '.join(known)}"
    shorthand = f" (or write DEVICE:NODESxGPUS, e.g. {SHORTHAND_EXAMPLE})" if kind_dir == "clusters" else ""
    raise ProfileError(f"{what} {name_or_path!r}: unknown; {hint}{shorthand}")


def read_mapping(path: Path) -> dict:
    """Parse a YAML or JSON file whose top level is a mapping; errors stay on one line."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read ({exc}); check the file") from None
    try:
        data = load_text(text, path.suffix == ".json")
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    except ValueError as exc:  # a JSON key given twice
        raise ProfileError(f"{path}: invalid JSON ({exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "unparseable"
        raise ProfileError(f"{path}{line}: invalid YAML ({problem})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: top level must be a mapping of keys to values (see profiles/README.md)")
    return data


# Keys only one kind of profile has at its top level, and the kind they mark.
KIND_MARKERS = (
    (("groups", "oversubscription"), "cluster"),
    (("peak_flops_per_s", "mem_bytes", "mem_bw_bytes_per_s", "matmul_efficiency", "nic", "node", "op_tables"), "device"),
    (("bw_bytes_per_s", "latency_s", "kind"), "link"),
)


def profile_kind(data: dict) -> str | None:
    """"cluster", "device" or "link": the kind of profile a mapping is, from a key only that kind has
    (the first kind with one, so a device file missing its peaks or with a typo is still a device)."""
    return next((kind for keys, kind in KIND_MARKERS if any(key in data for key in keys)), None)


def file_kind(text: str) -> str | None:
    """`profile_kind` of the profile file `text` names; None where it names no readable profile file
    (the loaders then say why)."""
    if not looks_like_path(text):
        return None
    try:
        path = Path(text).expanduser()
    except RuntimeError:  # "~user" naming no known user
        return None
    if not is_file(path):
        return None
    try:
        return profile_kind(read_mapping(path))
    except ProfileError:
        return None


def relative_to(base: Path, ref: str) -> str:
    """A file reference inside a profile is relative to that profile's directory."""
    return str(base / ref) if looks_like_path(ref) and not Path(ref).expanduser().is_absolute() else ref


def load_op_table(path: str) -> OpTable:
    """A measured op table a device profile names in `op_tables` (JSON of `OpTable.to_dict`, written by
    `paraplan profile`).

    Raises:
        ProfileError: one line naming the file, when it cannot be read or is not an op table.
    """
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ProfileError(f"expected a mapping, got {type(data).__name__}")
        return OpTable.from_dict(data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, ProfileError) as exc:
        reason = str(exc).removeprefix("op table: ")
        raise ProfileError(f"{path}: not a readable op table ({reason}); re-run `paraplan profile`") from None


# How to use a profile of one kind (key) where another was expected.
KIND_USES = {
    "device": "write {label}:NODESxGPUS (e.g. {label}:1x8) for a cluster of it, or name it as a cluster group's device",
    "link": "name it as a device's or a cluster group's intra_link or nic",
    "cluster": "give it as --cluster; a cluster file names its devices in groups",
}


def check_kind(origin: Origin, data: dict, expected: str) -> None:
    """Refuse, in one line saying how to use it, a profile of another kind than `expected`."""
    kind = profile_kind(data)
    if kind is not None and kind != expected:
        raise ProfileError(f"{origin.label}: a {kind} profile, not a {expected}; "
                           + KIND_USES[kind].format(label=origin.label))
