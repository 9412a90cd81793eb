"""A group that torchrun restarts (``--max-restarts``) meets on a store of its own.

Measured with torch 2.13 on CPU (gloo), ``torchrun --standalone --max-restarts 1``, one
rank SIGKILLed: the restarted workers are handed the agent's store again
(``TORCHELASTIC_USE_AGENT_STORE=True``, the same ``MASTER_PORT``), and their process group
often never forms: both wait in gloo's ``connectFullMesh`` until the group's timeout (30
min by default): 5 of 6 tries of ``scripts/repro_elastic_store.py``, which passes 3 of 3
when the restarted group uses a store of its own (``STORE_FIX=1``). So on a
restart (``TORCHELASTIC_RESTART_COUNT`` > 0), before anything starts a process group, rank
0 picks a free port on its host and publishes it in the agent's store under this
attempt's key; every rank then points ``MASTER_ADDR``/``MASTER_PORT`` at it and rank 0
hosts the store there (``TORCHELASTIC_USE_AGENT_STORE=False``).

When a rank dies, the others fail in their next collective with gloo's own error and its
C++ source path; each says so in one line instead (``peer_lost_line``, ``PeerLost``): what
the rank lost, and what torchrun does next (a restart while ``--max-restarts`` allows).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

STORE_TIMEOUT = timedelta(seconds=600)  # the other ranks of a restart start within this

# gloo's words when the process at the other end of a collective is gone (torch 2.13 on CPU:
# "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:PORT. This is
# typically caused by a remote worker crashing. ..."); the others are the same socket's
# other ways to say it
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class PeerLost(SystemExit):
    """A rank's collective failed because a peer's process died: the process group is
    broken for good and torchrun ends or restarts the group. A ``SystemExit`` (code 1, a
    crash: ``stabilize/exits.py``) so that nothing above prints it again: the line was said."""

    def __init__(self, line: str):
        super().__init__(1)
        self.line = line


def peer_lost_line(error: BaseException, rank: int, gone: list[int]) -> str | None:
    """One line for a collective that failed because a peer died (``gone``: the ranks known
    dead, from the watchdog's beats); None for any other error."""
    words = next((w for w in PEER_GONE if w in str(error)), None)
    if words is None:
        return None
    who = f"rank {', '.join(map(str, gone))}" if gone else "a peer rank"
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restart_count() < restarts:
        then = f"torchrun restarts the group (restart {restart_count() + 1} of {restarts})"
    else:
        then = "no restart left (torchrun --max-restarts): the launch ends; resume=auto goes on"
    return f"rank {rank}: {who} died (gloo: {words.lower()}); {then}"


def fresh_store_for_restart() -> tuple[str, int] | None:
    """On a restart under the agent's store: the (host, port) every rank now meets on (the
    environment is set); None otherwise (nothing done)."""
    attempt = restart_count()
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed import TCPStore

    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                     is_master=False, timeout=STORE_TIMEOUT)  # fmt: skip
    key = f"stabilize/attempt-{attempt}/store"
    if int(os.environ.get("RANK", "0")) == 0:
        with socket.socket() as s:  # a port free now; rank 0's group store binds it next
            s.bind(("", 0))
            port = s.getsockname()[1]
        host = socket.gethostname()
        agent.set(key, f"{host}:{port}")
    else:
        host, port_text = agent.get(key).decode().rsplit(":", 1)
        port = int(port_text)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="False")  # fmt: skip
    return host, port
