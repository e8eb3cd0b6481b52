"""Rich tables for `paraplan hardware [NAME]`: the built-in devices, links and clusters, or one in detail."""
from __future__ import annotations

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from costmodel.errors import ProfileError
from costmodel.hardware import Cluster, DeviceSpec, LinkTier
from costmodel.profile_files import file_kind, list_clusters, list_devices, list_links, looks_like_path, nearest_names
from costmodel.profile_links import load_link
from costmodel.profile_loader import load_cluster, load_device

FLOPS_PER_TFLOP = 1e12
BYTES_PER_GIB = 2**30
BYTES_PER_GB = 1e9
BYTES_PER_TB = 1e12
US_PER_S = 1e6
LIST_DTYPE = "bf16"
MISSING = "-"
CURVE_POINTS_SHOWN = 5


def render_hardware_list() -> RenderableType:
    """Three tables: every known device (peak, memory, node, NIC, price), link and cluster.

    A profile on the search path that does not load is left out of its table and named below the
    tables with the reason, so one broken file does not hide the rest.

    Returns:
        A rich renderable.
    """
    problems: list[str] = []
    devices = Table(title="Devices", title_justify="left")
    device_names = list_devices()
    for column in ("Device", f"{LIST_DTYPE} TFLOP/s", "Memory GiB", "Mem TB/s", "Node", "NIC", "$/device-h"):
        _name_column(devices, column, device_names) if column == "Device" else devices.add_column(
            column, justify="left" if column in ("Node", "NIC") else "right", overflow="fold")
    for name, device in _loaded(device_names, load_device, problems):
        peak = device.peak_flops_per_s.get(LIST_DTYPE)
        _row(devices, name, f"{peak / FLOPS_PER_TFLOP:.1f}" if peak else MISSING,
             f"{device.mem_bytes / BYTES_PER_GIB:.1f}", f"{device.mem_bw_bytes_per_s / BYTES_PER_TB:.2f}",
             f"{device.devices_per_node} x {_link_brief(device.intra_link)}", _link_brief(device.nic),
             f"{device.price_per_hour:.2f}" if device.price_per_hour else MISSING)
    links = Table(title="Links (intra-node links and NICs the devices and clusters name)", title_justify="left")
    link_names = list_links()
    for column in ("Link", "Kind", "GB/s per direction", "Latency us", "Efficiency"):
        _name_column(links, column, link_names) if column == "Link" else links.add_column(
            column, justify="left" if column == "Kind" else "right", overflow="fold")
    for name, link in _loaded(link_names, load_link, problems):
        _row(links, name, str(link.kind), f"{link.bw_bytes_per_s / BYTES_PER_GB:g}", f"{link.latency_s * US_PER_S:g}",
             f"{link.efficiency:g}")
    clusters = Table(title="Clusters", title_justify="left")
    cluster_names = list_clusters()
    for column in ("Cluster", "Devices", "Nodes", "Node groups", "Oversubscription"):
        _name_column(clusters, column, cluster_names) if column == "Cluster" else clusters.add_column(
            column, justify="right" if column in ("Devices", "Nodes") else "left", overflow="fold")
    for name, cluster in _loaded(cluster_names, load_cluster, problems):
        _row(clusters, name, str(cluster.num_devices), str(cluster.num_nodes), _groups_brief(cluster),
             f"{cluster.oversubscription:g}:1")
    if not problems:
        return Group(devices, links, clusters)
    return Group(devices, links, clusters, Text("Not listed, their profiles do not load:", style="bold red"),
                 *(Text(f"  {problem}", style="red") for problem in problems))


def _name_column(table: Table, header: str, names: list[str]) -> None:
    """A column of the names a user types: never cut, whatever the terminal's width (the other
    columns fold their text instead)."""
    table.add_column(header, no_wrap=True, min_width=max(map(len, names), default=len(header)))


def _loaded(names: list[str], load, problems: list[str]):
    """(name, loaded profile) for each name in turn; a name whose profile fails adds its error to `problems`."""
    for name in names:
        try:
            yield name, load(name)
        except ProfileError as error:
            problems.append(str(error))


def render_hardware(name: str) -> RenderableType:
    """One device, link or cluster in detail, each number with its source.

    Args:
        name: a device, link or cluster name or file, or a `DEVICE:NODESxGPUS` shorthand.

    Returns:
        A rich renderable.

    Raises:
        ProfileError: the name is unknown (the message lists the nearest names) or its profile is invalid.
    """
    key = name.strip().lower()
    devices, links, clusters = list_devices(), list_links(), list_clusters()
    if key in devices:
        return _render_device(load_device(key))
    if key in links:
        return _render_link(load_link(key))
    kind = file_kind(name)
    if kind == "device":
        return _render_device(load_device(name))
    if kind == "link":
        return _render_link(load_link(name))
    if key in clusters or ":" in key or looks_like_path(name):
        return _render_cluster(load_cluster(name))
    close = nearest_names(key, devices + links + clusters)
    hint = f"did you mean {', '.join(close)}" if close else "run `paraplan hardware` for the list"
    raise ProfileError(f"hardware {name!r}: not a known device, link or cluster; {hint}")


def _render_device(device: DeviceSpec) -> RenderableType:
    table = Table(title=escape(device.name), title_justify="left")
    for column in ("Field", "Value", "Source"):
        table.add_column(column, overflow="fold")
    source = device.source
    _row(table, "description", device.description, "")
    for i, (dtype, peak) in enumerate(device.peak_flops_per_s.items()):
        _row(table, f"peak {dtype}", f"{peak / FLOPS_PER_TFLOP:.1f} TFLOP/s",
             source.get("peak_flops_per_s", "") if i == 0 else "")
    _row(table, "memory", f"{device.mem_bytes / BYTES_PER_GIB:.2f} GiB ({device.mem_bytes:,.0f} bytes)",
         source.get("mem_bytes", ""))
    _row(table, "memory bandwidth", f"{device.mem_bw_bytes_per_s / BYTES_PER_TB:.2f} TB/s",
         source.get("mem_bw_bytes_per_s", ""))
    if device.mem_bw_efficiency != 1.0:
        _row(table, "memory bandwidth efficiency", f"{device.mem_bw_efficiency:.2f}",
             source.get("mem_bw_efficiency", ""))
    _row(table, "matmul efficiency", _curve_brief(device.matmul_efficiency), source.get("matmul_efficiency", ""))
    if device.flash2_attention_ratio != (1.0, 1.0):
        fwd, bwd = device.flash2_attention_ratio
        _row(table, "FlashAttention-2 rate", f"{fwd:.2f} forward, {bwd:.2f} backward of the flash kernels' rate",
             source.get("flash2_attention_ratio", ""))
    _row(table, "devices per node", str(device.devices_per_node), source.get("node", ""))
    _row(table, "intra-node link", _link_detail(device.intra_link), device.intra_link.source)
    _row(table, "host memory per node", f"{device.host_mem_bytes / BYTES_PER_GIB:,.0f} GiB" if device.host_mem_bytes
         else f"{MISSING} (offloaded states are not checked)", source.get("host_mem_bytes", ""))
    _row(table, "NIC per device", _link_detail(device.nic),
         "; ".join(text for text in (source.get("nic", ""), device.nic.source) if text))
    if device.price_per_hour:
        _row(table, "price", f"${device.price_per_hour:.2f} per device-hour", source.get("price_per_hour", ""))
    if device.power_w:
        _row(table, "power", f"{device.power_w:.0f} W", source.get("power_w", ""))
    return table


def _render_link(link: LinkTier) -> RenderableType:
    table = Table(title=escape(link.name), title_justify="left")
    for column in ("Field", "Value"):
        table.add_column(column, overflow="fold")
    _row(table, "kind", str(link.kind))
    _row(table, "bandwidth", f"{link.bw_bytes_per_s / BYTES_PER_GB:g} GB/s per direction per device")
    _row(table, "latency", f"{link.latency_s * US_PER_S:g} us per message")
    _row(table, "efficiency", f"{link.efficiency:g} of the bandwidth reached by collectives")
    for collective, factor in link.collective_factors:
        _row(table, f"{collective} factor", f"{factor:g} x its ring formula (measured)")
    _row(table, "sources", link.source)
    return table


def _render_cluster(cluster: Cluster) -> RenderableType:
    summary = Table(title=escape(cluster.name), title_justify="left", show_header=False)
    summary.add_column("Field")
    summary.add_column("Value", overflow="fold")
    _row(summary, "description", cluster.description)
    _row(summary, "devices", str(cluster.num_devices))
    _row(summary, "nodes", str(cluster.num_nodes))
    _row(summary, "oversubscription", f"{cluster.oversubscription:g}:1")
    _row(summary, "smallest device memory", f"{cluster.min_device_mem_bytes / BYTES_PER_GIB:.2f} GiB")
    for field_name, text in cluster.source.items():
        _row(summary, f"source: {field_name}", text)
    groups = Table(title="Node groups", title_justify="left")
    for column in ("Device", "Nodes", "Devices/node", "Intra-node link", "NIC per device", "Memory GiB",
                   "Host GiB/node", f"{LIST_DTYPE} TFLOP/s"):
        groups.add_column(column)
    for group in cluster.groups:
        node = group.node
        peak = node.device.peak_flops_per_s.get(LIST_DTYPE)
        _row(groups, node.device.name, str(group.count), str(node.devices_per_node),
             _link_detail(node.intra_link), _link_detail(node.nic),
             f"{node.device.mem_bytes / BYTES_PER_GIB:.1f}",
             f"{node.host_mem_bytes / BYTES_PER_GIB:,.0f}" if node.host_mem_bytes else MISSING,
             f"{peak / FLOPS_PER_TFLOP:.1f}" if peak else MISSING)
    groups.caption = "each device's numbers with their sources: paraplan hardware DEVICE (its name or file)"
    return Group(summary, groups)


def _row(table: Table, *cells: str) -> None:
    """Add a row whose cells are plain text (profile strings may hold [brackets] rich would parse)."""
    table.add_row(*(Text(cell) for cell in cells))


def _link_brief(link: LinkTier) -> str:
    return f"{link.name} ({link.bw_bytes_per_s / BYTES_PER_GB:g} GB/s)"


def _link_detail(link: LinkTier) -> str:
    nvls = (f"; in-switch all-reduce (NVLS) at {link.nvls_efficiency:g} of that, {link.nvls_latency_s * US_PER_S:g} us"
            if link.nvls_efficiency else "")
    return (f"{link.name} ({link.kind}): {link.bw_bytes_per_s / BYTES_PER_GB:g} GB/s per direction,"
            f" {link.latency_s * US_PER_S:g} us, efficiency {link.efficiency:g}{nvls}")


def _groups_brief(cluster: Cluster) -> str:
    return " + ".join(f"{g.count} x {g.node.devices_per_node} {g.node.device.name}" for g in cluster.groups)


def _curve_brief(curve: tuple[tuple[float, float], ...]) -> str:
    """About CURVE_POINTS_SHOWN evenly spaced points of the curve, always ending with the last."""
    if not curve:
        return MISSING
    step = max(1, (len(curve) - 1) // (CURVE_POINTS_SHOWN - 1))
    shown = list(curve[::step]) + ([curve[-1]] if (len(curve) - 1) % step else [])
    return ", ".join(f"{fraction:.3f} at {flops:.0e} FLOP" for flops, fraction in shown)
