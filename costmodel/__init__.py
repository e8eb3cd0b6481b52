"""Prices work (FLOPs, bytes, collectives) on hardware. Never imports `planner`."""
from costmodel.profile_loader import load_cluster, load_device

__all__ = ["load_cluster", "load_device"]
