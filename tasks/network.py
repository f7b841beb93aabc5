"""Addresses as every layer reads them (the engine's rendezvous, the production servers)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """`host` (a name or an address literal, not resolved) names this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
