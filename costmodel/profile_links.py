"""Link profiles (`links/*.yaml`, or inline in a device or cluster file) as `costmodel.hardware.LinkTier`s.

Parsed files are cached per process and parsed again after they change (`profile_loader` for devices
and clusters).
"""
from __future__ import annotations

import functools
from pathlib import Path

from costmodel import profile_fields as fields
from costmodel.comm import Collective
from costmodel.errors import ProfileError
from costmodel.hardware import LinkKind, LinkTier
from costmodel.profile_fields import Origin
from costmodel.profile_files import check_kind, profile_dirs, read_mapping, relative_to, resolve

_LINK_KEYS = ("name", "kind", "bw_bytes_per_s", "latency_s", "efficiency", "collective_factors", "peer_bw_bytes_per_s",
              "nvls_efficiency", "nvls_latency_s", "sources")
_LINK_REQUIRED = ("kind", "bw_bytes_per_s", "latency_s")


def load_link(name_or_path: str | Path) -> LinkTier:
    """Load a link profile by name (`profile_files.list_links()`, case-insensitive) or by file path.

    Raises:
        ProfileError: unknown name, missing file, or invalid profile; the message names the fix.
    """
    path = resolve("links", "link", name_or_path, profile_dirs())
    return _load_link_file(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _load_link_file(path: str, mtime_ns: int) -> LinkTier:
    data = read_mapping(Path(path))
    check_kind(Origin(path), data, "link")
    return _parse_link(Origin(path), "", data, Path(path).stem, allowed=None)


def link_field(origin: Origin, field_name: str, value, dirs: tuple[Path, ...], base: Path, allowed) -> LinkTier:
    """A link given by profile name (`links/NAME.yaml`), by file path, or inline as a mapping."""
    if isinstance(value, dict):
        return _parse_link(origin, f"{field_name}.", value, None, allowed)
    if not isinstance(value, str):
        raise origin.error(field_name, "must be a link name from profiles/links/ or a mapping with kind,"
                           " bw_bytes_per_s and latency_s")
    try:
        path = resolve("links", "link", relative_to(base, value), dirs)
    except ProfileError as exc:
        raise origin.error(field_name, str(exc)) from None
    link = _load_link_file(str(path), path.stat().st_mtime_ns)
    if allowed is not None and link.kind not in allowed:
        raise origin.error(field_name, f"link {value!r} is of kind '{link.kind}', which cannot serve here;"
                           f" use one of kinds {', '.join(sorted(allowed))}")
    return link


def _parse_link(origin: Origin, prefix: str, data: dict, default_name: str | None, allowed) -> LinkTier:
    """A LinkTier from a mapping; an inline link without a name is named after its kind."""
    fields.check_keys(origin, prefix, data, _LINK_KEYS, _LINK_REQUIRED)
    kind = fields.enum_member(origin, f"{prefix}kind", data["kind"], LinkKind)
    if allowed is not None and kind not in allowed:
        raise origin.error(f"{prefix}kind", f"{kind.value!r} cannot serve here; use one of"
                           f" {', '.join(sorted(allowed))}")
    sources = fields.sources(origin, prefix, data.get("sources", {}), _LINK_KEYS)
    bw_bytes_per_s = fields.physical(origin, f"{prefix}bw_bytes_per_s", data["bw_bytes_per_s"], fields.LINK_BANDWIDTH)
    peer_bytes_per_s = data.get("peer_bw_bytes_per_s")
    if peer_bytes_per_s is not None:
        peer_bytes_per_s = fields.physical(origin, f"{prefix}peer_bw_bytes_per_s", peer_bytes_per_s, fields.LINK_BANDWIDTH)
        if peer_bytes_per_s > bw_bytes_per_s:
            raise origin.error(f"{prefix}peer_bw_bytes_per_s", f"{peer_bytes_per_s:g} exceeds bw_bytes_per_s "
                               f"{bw_bytes_per_s:g}, a device's whole bandwidth; give one pair's share")
    nvls_efficiency, nvls_latency_s = _nvls(origin, prefix, data, kind)
    return LinkTier(
        name=fields.text(origin, f"{prefix}name", data.get("name", default_name or kind.value)),
        kind=kind,
        bw_bytes_per_s=bw_bytes_per_s,
        latency_s=fields.physical(origin, f"{prefix}latency_s", data["latency_s"], fields.LATENCY),
        efficiency=fields.fraction(origin, f"{prefix}efficiency", data.get("efficiency", 1.0)),
        source="; ".join(f"{key}: {text}" for key, text in sources.items()),
        collective_factors=_collective_factors(origin, f"{prefix}collective_factors",
                                               data.get("collective_factors", {})),
        peer_bw_bytes_per_s=peer_bytes_per_s,
        nvls_efficiency=nvls_efficiency,
        nvls_latency_s=nvls_latency_s,
    )


def _nvls(origin: Origin, prefix: str, data: dict, kind: LinkKind) -> tuple[float, float]:
    """A switch's in-switch reduction: (nvls_efficiency, nvls_latency_s), both given or neither; (0, 0) without."""
    given = [key for key in ("nvls_efficiency", "nvls_latency_s") if key in data]
    if not given:
        return 0.0, 0.0
    if len(given) == 1:
        missing = "nvls_latency_s" if given == ["nvls_efficiency"] else "nvls_efficiency"
        raise origin.error(f"{prefix}{missing}", f"missing: the in-switch all-reduce needs both nvls_efficiency and "
                           f"nvls_latency_s; add {missing} or remove {given[0]}")
    if kind is not LinkKind.NVSWITCH:
        raise origin.error(f"{prefix}nvls_efficiency", f"only an nvswitch reduces in the switch, and this link is "
                           f"'{kind.value}'; remove nvls_efficiency and nvls_latency_s")
    return (fields.fraction(origin, f"{prefix}nvls_efficiency", data["nvls_efficiency"]),
            fields.physical(origin, f"{prefix}nvls_latency_s", data["nvls_latency_s"], fields.LATENCY))


def _collective_factors(origin: Origin, field_name: str, value) -> tuple[tuple[str, float], ...]:
    """A link's measured collective factors: a mapping from collective name to a positive number."""
    if not isinstance(value, dict):
        raise origin.error(field_name, "must be a mapping of collective to factor, e.g. {all_gather: 2.5}")
    factors = []
    for name, factor in value.items():
        kind = fields.enum_member(origin, f"{field_name}.{name}", name, Collective)
        factors.append((kind.value, fields.positive(origin, f"{field_name}.{name}", factor)))
    return tuple(sorted(factors))
