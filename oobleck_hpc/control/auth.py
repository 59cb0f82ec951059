"""The run's secret, and the authenticated connections between node agents. Stdlib only.

The secret: 256 random bits, generated when a run begins (runs.begin: the local launcher, a
Slurm job's first attempt) into RUN_DIR/secret, mode 0600, and kept by the run's requeued
attempts and the nodes grown into it (they read the same file). Agents and workers find it by
path, in $OOBLECK_SECRET_FILE (default RUN_DIR/secret) -- never on a command line.

A connection (links.py opens it, inbound.py accepts it) costs no round trip:

1. the connector's first frame is its HELLO {src, to, host, port, nonce, ts}: its own name, the
   accepter's, its address, 16 fresh random bytes and its clock; the connection's two keys are
   derived from the secret, the nonce and both names (`keys`), and the HELLO is sealed with the
   connector's (below) -- its MAC proves that the sender knows the secret, under that name, for
   this accepter;
2. the accepter takes it only if `ts` is within SKEW_S of its own clock and it has not seen the
   nonce before (`Replays`: the nonces whose clock could still pass), so a recorded connection
   cannot be played again;
3. every frame, both ways, HELLO first, is sealed: 32 bytes HMAC-SHA256(key of its direction,
   sequence number (8 bytes) + body) before its JSON body. The sequence number counts the
   frames of that direction of that connection from 0 and is never sent: a frame dropped,
   reordered, replayed from another connection (another nonce) or attributed to another node
   (another name) fails.

Before its HELLO verifies, an accepted connection may send at most PRE_AUTH_BYTES, and it is
closed after AUTH_DEADLINE_S (inbound.py). (A challenge sent by the accepter would cost every
new connection a round trip: beyond OUT_CAP peers a link is opened per message, and a
coordinator's round of a 256-node job took twice as long that way.)
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from oobleck_hpc.errors import ConfigError
from oobleck_hpc.files import atomic_open

SECRET_FILE = "secret"
SECRET_ENV = "OOBLECK_SECRET_FILE"
MAC_BYTES = 32
PRE_AUTH_BYTES = 4096
"""Bytes an accepted connection may send before its HELLO is verified (a HELLO is ~200)."""
AUTH_DEADLINE_S = 2.0
"""An accepted connection whose HELLO is not verified by then is closed."""
SKEW_S = 120.0
"""A HELLO's clock may differ from the accepter's by this much (cluster nodes keep NTP time)."""


class AuthFailed(ValueError):
    """A frame whose MAC does not verify, or a HELLO that is stale or replayed."""


# ---------------------------------------------------------------------- the secret file


def secret_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where this process finds the run's secret: $OOBLECK_SECRET_FILE, else RUN_DIR/secret."""
    return Path(os.environ.get(SECRET_ENV) or Path(run_dir) / SECRET_FILE)


def write_secret(run_dir: str | os.PathLike[str], fresh: bool) -> Path:
    """RUN_DIR/secret, created (mode 0600, 256 random bits as hex) if missing or if `fresh` (a
    new run: the old one's agents must not speak to it); an existing one is kept otherwise (a
    requeued attempt of the same run). Returns its path."""
    path = Path(run_dir) / SECRET_FILE
    if path.exists() and not fresh:
        return path
    with atomic_open(path, durable=True) as f:
        os.fchmod(f.fileno(), 0o600)  # (before the secret is in it, whatever the umask)
        f.write((secrets.token_hex(32) + "\n").encode())
    return path


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in `path`; refused if other users could read it (it would be no secret)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as e:
        raise ConfigError(str(path), "<file>", f"cannot be read ({e.strerror})",
                          f"start the run with its launcher (it writes RUN_DIR/{SECRET_FILE}), "
                          f"or point ${SECRET_ENV} at the run's secret") from e
    if mode & 0o077:
        raise ConfigError(str(path), "<mode>", f"is {oct(mode & 0o777)}: others may read it",
                          f"chmod 600 {path}")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ConfigError(str(path), "<file>", "does not hold a secret of 128 bits or more "
                          "as hex", "let the launcher write it")
    return secret


def run_secret(run_dir: str | os.PathLike[str]) -> bytes:
    """This process's run's secret (`secret_path`), checked (`load_secret`)."""
    return load_secret(secret_path(run_dir))


# ---------------------------------------------------------------------- connections


def keys(secret: bytes, nonce: str, src: str, to: str) -> tuple[bytes, bytes]:
    """The keys of a connection opened by node `src` to node `to` with `nonce`: (what the
    connector sends, what the accepter sends)."""
    base = "\0".join((nonce, src, to)).encode()
    return (hmac.digest(secret, b"oobleck connector\0" + base, "sha256"),
            hmac.digest(secret, b"oobleck accepter\0" + base, "sha256"))


class Sealer:
    """One direction of one connection: seals the frames its sender writes, or opens those its
    reader reads, in order (the sequence number counts them)."""

    def __init__(self, key: bytes):
        self.key = key
        self.seq = 0

    def _mac(self, body: bytes) -> bytes:
        mac = hmac.digest(self.key, self.seq.to_bytes(8, "big") + body, "sha256")
        self.seq += 1
        return mac

    def seal(self, body: bytes) -> bytes:
        """The payload of the next frame: its MAC, then `body`."""
        return self._mac(body) + body

    def open(self, payload: bytes) -> bytes:
        """The body of the next frame read; raises AuthFailed if its MAC does not verify."""
        if len(payload) < MAC_BYTES or not hmac.compare_digest(
                payload[:MAC_BYTES], self._mac(payload[MAC_BYTES:])):
            raise AuthFailed("a frame's MAC does not verify (not from the run's nodes, replayed, "
                             "or out of order)")
        return payload[MAC_BYTES:]


def hello(secret: bytes, src: str, to: str, host: str, port: int) -> tuple[bytes, Sealer, Sealer]:
    """A connector's HELLO body and its connection's (sealer, opener); the HELLO is the
    sealer's first frame."""
    nonce = secrets.token_hex(16)
    msg = {"type": "hello", "src": src, "to": to, "host": host, "port": port, "nonce": nonce,
           "ts": time.time()}
    out, back = keys(secret, nonce, src, to)
    return json.dumps(msg, separators=(",", ":")).encode(), Sealer(out), Sealer(back)


class Replays:
    """The nonces of the HELLOs an accepter took whose clock is still within SKEW_S of its own:
    a HELLO is taken once (`check`), and only while fresh. Only verified HELLOs enter it, so
    its size is bounded by the run's own connections over 2 x SKEW_S."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}
        self._pruned = 0.0

    def check(self, msg: dict[str, Any], now: float | None = None) -> None:
        """Raises AuthFailed unless verified HELLO `msg` is fresh and new; records it."""
        now = time.time() if now is None else now
        if abs(now - msg["ts"]) > SKEW_S:
            raise AuthFailed(f"HELLO from {msg['src']!r} is {now - msg['ts']:+.0f} s old (more "
                             f"than {SKEW_S:.0f} s: a replay, or clocks out of sync)")
        if msg["nonce"] in self.seen:
            raise AuthFailed(f"HELLO from {msg['src']!r} replayed")
        if now - self._pruned > SKEW_S:
            self.seen = {n: t for n, t in self.seen.items() if now - t <= SKEW_S}
            self._pruned = now
        self.seen[msg["nonce"]] = msg["ts"]
