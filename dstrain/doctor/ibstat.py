"""Parse saved `ibstat` output (CA blocks with their ports) into IBPort records.

Tolerates what pastes do to it: tabs turned to spaces, CRLF, markdown fences, a prompt or log
header before the first `CA '...'`, interleaved `ibwarn`/`ibpanic` lines, elided values (`...`),
and a truncated last block (its missing fields stay None)."""

import re

from dstrain.doctor.infiniband import IBPort

CA = re.compile(r"^\s*CA\s+'([^']+)'")
PORT = re.compile(r"^\s*Port\s+(\d+)\s*:\s*$")
# Any blanks between a field's words: pastes rewrite them.
FIELD = re.compile(r"^\s*(CA\s+type|State|Physical\s+state|Rate|Link\s+layer)\s*:\s*(.*?)\s*$")
KEYS = {"State": "state", "Physical state": "physical_state", "Link layer": "link_layer"}


class IbstatParseError(ValueError):
    """The text holds no `ibstat` CA block."""


def parse_ibstat(text: str) -> list[IBPort]:
    """Every port of every CA in `text`; IbstatParseError when there is no `CA '...'` line."""
    ports: list[IBPort] = []
    ca: str | None = None
    ca_type: str | None = None
    port: dict | None = None
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if match := CA.match(line):
            ports += _close(ca, ca_type, port)
            ca, ca_type, port = match.group(1), None, None
        elif ca and (match := PORT.match(line)):
            ports += _close(ca, ca_type, port)
            port = {"port": int(match.group(1))}
        elif ca and (match := FIELD.match(line)):
            key, value = " ".join(match.group(1).split()), _value(match.group(2))
            if key == "CA type":
                ca_type = value
            elif port is not None:
                port[KEYS.get(key, "rate")] = value
    ports += _close(ca, ca_type, port)
    if ca is None:
        raise IbstatParseError("no `ibstat` output found (no line like CA 'mlx5_0')")
    return ports


def _value(text: str) -> str | None:
    text = " ".join(text.split())  # `Port Configuration Training`, whatever its blanks
    return None if text in ("", "...") else text


def _close(ca: str | None, ca_type: str | None, port: dict | None) -> list[IBPort]:
    if ca is None or port is None:
        return []
    rate = port.get("rate")
    match = re.match(r"[\d.]+", rate or "")
    return [
        IBPort(
            ca,
            port["port"],
            port.get("state"),
            port.get("physical_state"),
            float(match.group(0)) if match else None,
            port.get("link_layer"),
            ca_type,
        )
    ]
