"""Every message node agents send each other, declared once: its type and its fields' types.

An agent decodes and checks each frame before it acts on it (`parse`): a JSON object whose
"type" is below and whose required fields are present with these types (more fields are
ignored). Anything else raises BadMessage: the event loop closes that one connection and records
`frame_rejected` (inbound.py, links.py); it never reaches the membership core, whose handlers may then index
the fields they need without checking them again. Stdlib only.
"""

from __future__ import annotations

import json
from typing import Any, Callable

Check = Callable[[Any], bool]


class BadMessage(ValueError):
    """A frame that is not a well-formed message of a known type (the reason is the text)."""


def _int(v: Any) -> bool:
    return type(v) is int


def _str(v: Any) -> bool:
    return type(v) is str


def _num(v: Any) -> bool:
    return type(v) in (int, float)


def _names(v: Any) -> bool:
    return type(v) is list and all(type(x) is str for x in v)


def _reasons(v: Any) -> bool:
    return type(v) is dict and all(type(x) is str for x in v.values())


def _by_node(v: Any) -> bool:
    return type(v) is dict  # (JSON object keys are always strings)


def _any(v: Any) -> bool:
    return True


DECISION: dict[str, Check] = {"gen": _int, "nodes": _names, "lost": _names, "store_node": _str,
                              "store_port": _int, "joined": _names}
"""A decided generation (decision.py: Decision.to_msg)."""


def _decision(v: Any) -> bool:
    return type(v) is dict and _problem(v, DECISION) is None


MESSAGES: dict[str, dict[str, Check]] = {
    # links.py, inbound.py: the first message on a connection (auth.py), its end, and the reader's request
    # to close it
    "hello": {"src": _str, "to": _str, "host": _str, "port": _int, "nonce": _str, "ts": _num},
    "unlink": {},
    "drop": {},
    # plane.py / topology.py: liveness
    "heartbeat": {"gen": _int},
    "ping": {},
    "pong": {},
    "report": {"gen": _int, "node": _str, "how": _str},
    # membership.py
    "bye": {"how": _str, "code": _int, "reason": _str},
    "join": {"how": _str},
    "failed": {"how": _str},
    "fence": {"gen": _int, "nodes": _names},
    "propose": {"round": _int, "view": _names, "port": _int, "decided": _decision,
                "reasons": _reasons, "readmits": _names},
    "decided": DECISION,
    # exchange.py
    "exchange": {"xgen": _int, "key": _str, "value": _any},
    "exchange_done": {"xgen": _int, "key": _str, "values": _by_node},
}


def _problem(msg: dict[str, Any], fields: dict[str, Check]) -> str | None:
    for name, check in fields.items():
        if name not in msg:
            return f"no field {name!r}"
        if not check(msg[name]):
            return f"field {name!r} has the wrong type ({type(msg[name]).__name__})"
    return None


def validate(msg: Any) -> dict[str, Any]:
    """`msg` itself if it is a well-formed message of a known type; else raises BadMessage."""
    if type(msg) is not dict:
        raise BadMessage(f"not a JSON object but {type(msg).__name__}")
    kind = msg.get("type")
    fields = MESSAGES.get(kind) if type(kind) is str else None
    if fields is None:
        raise BadMessage(f"unknown message type {str(kind)[:40]!r}")
    problem = _problem(msg, fields)
    if problem is not None:
        raise BadMessage(f"{kind}: {problem}")
    return msg


def parse(body: bytes) -> dict[str, Any]:
    """One frame's body decoded and validated; raises BadMessage."""
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise BadMessage(f"not JSON ({type(e).__name__}: {str(e)[:80]})") from None
    return validate(msg)
