"""Occult's collaborative communication: one row per (token, destination device),
BRIM index maps, and the ORI / SFD / EPD token states."""
from .brim import Brim0, Brim1, build_brim0, build_brim1

__all__ = ["Brim0", "Brim1", "build_brim0", "build_brim1"]
