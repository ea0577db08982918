"""The address a replica group hands the Lighthouse and its peers ([Note: the addresses a
group advertises]): one host address for its store, its ManagerServer, the heal transport's
HTTP server and its cross-group Gloo pairs, reachable from the other groups' hosts.

    host = advertised_host(ft.advertise_host, lighthouse)   # ConfigError if not this host's
    pg = bound_to(host, pg_class)(timeout=...)               # Gloo pairs on `host`
    transport = AdvertisedHTTPTransport(host, timeout)        # heals fetched from `host`
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
from torchft.checkpointing import HTTPTransport

from trainer.errors import ConfigError

# [Note: the addresses a group advertises]
# A group hands out four addresses: its store (the cross-group process group of a quorum
# meets in the store of one of its groups), its ManagerServer (a healing peer asks it where
# the state is), the heal transport's HTTP server (the state) and the listening end of its
# Gloo pairs (the AllReduce). torchft 0.2.0 names the ManagerServer and the HTTP server by
# socket.gethostname(), this trainer named a one-rank group's store 127.0.0.1, and Gloo binds
# the address the host name resolves to (or GLOO_SOCKET_IFNAME's): none of these is known
# to reach this host from another. A host name may resolve to a loopback address
# (/etc/hosts), to nothing on the peer's side, or to the same name on every host (network
# namespaces share one). So all four use one address: ft.advertise_host where given, else
# the address of the local interface that routes to the Lighthouse. That is the one
# interface the group knows the run's network reaches, since every group reaches the
# Lighthouse. It is found by connect() of a UDP socket to the Lighthouse and getsockname():
# the kernel picks the route and source address; no packet is sent. The servers still
# listen on every interface; only what is advertised changes.
# An ft.advertise_host that no interface of this host has (or a loopback address while the
# Lighthouse is elsewhere) is refused at start: nothing could ever connect to it. One this
# host has but a peer cannot reach (another network, a firewall) shows when a peer uses
# it, each use named in one line that holds the address: rank r of every group meets the
# others in the store of the (r mod n)-th of the n groups at the newest step (in the order
# of their ids) and connects its Gloo pairs, within ft.timeout_s ([Note: a cross-group
# process group that could not be set up]); a heal asks the source's ManagerServer within
# ft.connect_timeout_s ("failed to connect to http://HOST:PORT within timeout ...") and
# fetches its state within ft.timeout_s (`AdvertisedHTTPTransport`). The step is redone;
# ft.stall_timeout_s without a commit stops the group. A wrong address that is never used
# (not a store the quorum meets in, only the connecting end of Gloo pairs, never healed
# from) goes unnoticed: that group trains.


def advertised_host(advertise_host: str | None, lighthouse: str) -> str:
    """The address this rank advertises ([Note: the addresses a group advertises]): the
    given one, checked to be this host's, or the one routing to `lighthouse`
    (http://HOST:PORT). A bare IPv6 address (no brackets)."""
    if advertise_host:
        host = str(advertise_host).strip().strip("[]")
        routed = _routed_or_none(lighthouse)
        null = f"null for {routed}, the one" if routed else "null for the address"
        why = _not_local(host)
        if not why and _loopback(host) and routed and not _loopback(routed):
            why = "a loopback address, which no other host reaches"
        if why:
            raise ConfigError(
                f"ft.advertise_host={advertise_host} is not an address of this host that "
                f"other hosts reach ({why}): give the address of one of its interfaces that "
                f"the other replica groups reach, or {null} routing to ft.lighthouse"
            )
        return host
    try:
        return routed_to(lighthouse)
    except OSError as e:
        why = e.strerror or str(e)
        raise ConfigError(
            f"ft.lighthouse={lighthouse}: no local address routes to its host ({why}); give "
            "the Lighthouse's address, or set ft.advertise_host to this host's address that "
            "the other replica groups reach"
        ) from None


def routed_to(url: str) -> str:
    """The local address the kernel would send from to `url`'s host (no packet sent)."""
    parts = urlsplit(url if "//" in url else f"//{url}")
    if not parts.hostname:
        raise OSError(f"no host in {url!r}")
    family, kind, proto, _, where = socket.getaddrinfo(
        parts.hostname, parts.port or 29510, type=socket.SOCK_DGRAM
    )[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(where)
        return s.getsockname()[0]


def _routed_or_none(url: str) -> str | None:
    try:
        return routed_to(url)
    except OSError:
        return None


def _not_local(host: str) -> str:
    """Why `host` is no address of this host ('' where it is): a socket bound to it."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"it does not resolve: {e.strerror or e}"
    why = ""
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind(where)
                return ""
            except OSError as e:
                why = e.strerror or str(e)
    return why


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: what it resolves to was checked by _not_local


def in_url(host: str) -> str:
    """`host` as a URL writes it: an IPv6 address in brackets."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host  # a name


class AdvertisedHTTPTransport(HTTPTransport):
    """torchft's heal transport, fetched from at `host` rather than the host name; a
    fetch that fails names the address it tried."""

    def __init__(self, host: str, timeout: timedelta) -> None:
        self.host = host  # before the server starts: its start logs address()
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"http://{in_url(self.host)}:{port}/checkpoint/"

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        try:
            return super().recv_checkpoint(src_rank, metadata, step, timeout)
        except OSError as e:  # urllib's URLError, a socket timeout, a refused connection
            raise ConnectionError(
                f"the heal's state from {metadata} (ft.timeout_s={timeout.total_seconds():g}): "
                f"{getattr(e, 'reason', None) or e}"
            ) from e


def bound_to(host: str, pg_class: type) -> type:
    """torchft's reconfigurable Gloo process group `pg_class` (trainer/comm/replicas.py's
    membership-tracking one), its pairs listening on `host` (the one device Gloo advertises
    to its peers) instead of the host name's address; a quorum whose process group could not
    be set up names the store it met in, and its collectives fail as on a dead link
    ([Note: a cross-group process group that could not be set up])."""
    from torch.distributed import ProcessGroup, ProcessGroupGloo

    class BoundGloo(pg_class):
        failed: str | None = None  # why this quorum's process group is missing

        def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
            self.failed = None
            try:
                super().configure(store_addr, *args, **kwargs)
            except Exception as e:
                store = store_addr.split("/", 1)[0]
                self.failed = (
                    f"the cross-group process group (store {store}) was not set up within "
                    f"ft.timeout_s={self._timeout.total_seconds():g}: {type(e).__name__}: "
                    f"{_first_line(e)}"
                )
                self.changed = False  # no membership to check on it: see the Note
                raise ConnectionError(self.failed) from None

        @contextmanager
        def _run_context(self) -> Iterator[None]:
            if self._pg is None and self.failed:
                time.sleep(self._timeout.total_seconds())
                raise ConnectionError(self.failed)
            yield

        def _create_pg(self, store: Any, rank: int, world_size: int) -> ProcessGroup:
            options = ProcessGroupGloo._Options()
            options._timeout = self._timeout
            options._devices = [ProcessGroupGloo.create_device(hostname=host)]
            if self._global_ranks:
                options.global_ranks_in_group = self._global_ranks
            backend = ProcessGroupGloo(store, rank, world_size, options)
            pg = ProcessGroup(store, rank, world_size)
            pg._set_default_backend(ProcessGroup.BackendType.GLOO)
            # a CPU group's tensors (a GPU group gets NCCL, trainer/comm/replicas.py)
            pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
            return pg

    return BoundGloo


# [Note: a cross-group process group that could not be set up]
# torchft sets up a quorum's process group (`configure`: every rank meets the others in the
# store of one group, then Gloo connects the pairs) once per quorum id, and the id changes
# only when the groups in the quorum change. When that fails (a store or a Gloo pair that
# cannot be reached, a peer gone before it met the others) torchft records the error for
# the step and sets up nothing more until the membership changes: with a peer that stays
# unreachable, every later quorum is the same one, with no process group. Unchanged, the
# step loop then retried the membership check (an AllReduce on the missing group, failing
# at once) without end and without a word. Here the failure is named with the store's
# address, and every collective on the missing group fails as one on a dead link does:
# after ft.timeout_s, with that line. So each step tried does not commit, one line every
# ft.timeout_s (`ft: group 1: step 1 did not commit (ConnectionError: the cross-group
# process group (store 10.213.1.1:38983) was not set up within ft.timeout_s=3: ...):
# redone`), and ft.stall_timeout_s after the last commit the group stops with a checkpoint
# and one error line naming it. `changed` (replicas.py's flag for the membership check) is
# cleared: no step commits without a process group, and the next one set up raises the
# flag again, so the check still runs on every process group a step can commit on.


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""
