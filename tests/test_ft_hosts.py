"""Replica groups on two hosts ([Note: the addresses a group advertises] in
trainer/comm/addresses.py): two network namespaces this test makes, `a` and `b`, joined by
a veth pair whose addresses (10.213.0.0/24) exist only inside them. The Lighthouse runs in
`a` at its veth address, group 0 in `a` and group 1 in `b`, each as a user launches it on a
machine of its own (`python train.py`, torchrun for two ranks). Namespaces share the host
name, so only addresses get a group's store, ManagerServer, heal transport and Gloo pairs
across. Skipped where namespaces cannot be made (not root, no `ip`)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from ft_harness import clean_env, final_model, finished

torchft = pytest.importorskip("torchft", reason="torchft is in make install's extras")
ROOT = Path(__file__).resolve().parents[1]

A_ADDR, B_ADDR = "10.213.0.1", "10.213.0.2"  # the veth pair's ends, /24
# A second address of `a`, on its loopback in another /24: `b` has no route to it, so a
# group advertising it is reachable from its own host only (connects to it from `b` fail
# at once, "network unreachable": no packet leaves either namespace).
UNROUTED = "10.213.1.1"
NOWHERE = "10.213.0.9"  # in the veth's /24, on no interface at all
PORT = 29510  # the Lighthouse's, inside `a`
LIGHTHOUSE = f"http://{A_ADDR}:{PORT}"

# The small job of tests/test_ft.py (momentum: state a heal must carry), 6 steps.
BASE = [
    "model=mlp", "data=synthetic", "optim=sgd", "optim.momentum=0.9", "optim.lr=0.05",
    "train.steps=6", "train.log_every=3", "train.batch_size=64", "ckpt.every=0",
    "train.eval_every=0",
]  # fmt: skip
FT = ["ft.enabled=true", "ft.replica_groups=2", "ft.timeout_s=10", "ft.heartbeat_ms=50",
      f"ft.lighthouse={LIGHTHOUSE}"]  # fmt: skip


class Hosts:
    """The two namespaces, the veth pair between them, the Lighthouse in `a`, and every
    process started in them (each its own process group, killed on close)."""

    def __init__(self) -> None:
        tag = f"st-{os.getpid()}"
        self.ns = {"a": f"{tag}-a", "b": f"{tag}-b"}
        self.made: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def make(self) -> None:
        veth_a, veth_b = f"st{os.getpid()}a", f"st{os.getpid()}b"  # at most 15 characters
        for ns in self.ns.values():
            _ip("netns", "add", ns)
            self.made.append(ns)
        a, b = self.ns["a"], self.ns["b"]
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", a)
        _ip("link", "set", veth_b, "netns", b)
        for ns, dev, addr in ((a, veth_a, A_ADDR), (b, veth_b, B_ADDR)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            # torchrun --standalone and a group's own store live on the loopback
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", a, "addr", "add", f"{UNROUTED}/32", "dev", "lo")

    def start(
        self, host: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        with open(log, "w") as out:
            p = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[host], *argv], cwd=ROOT, env=clean_env(env),
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        p.log = log
        self.procs.append(p)
        return p

    def group(
        self, host: str, run_dir: Path, g: int, args: list[str] = (), nproc: int = 1,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:  # fmt: skip
        """Replica group g on `host`, writing to run_dir/g<g>."""
        launch = [sys.executable, "train.py"]
        if nproc > 1:
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                      f"--nproc-per-node={nproc}", "train.py"]  # fmt: skip
        argv = [*launch, *BASE, *FT, f"ft.replica_group={g}", f"hydra.run.dir={run_dir}/g{g}",
                *args]  # fmt: skip
        return self.start(host, argv, run_dir / f"g{g}-{time.monotonic_ns()}.log", env)

    def lighthouse(self, log_dir: Path) -> None:
        """torchft's Lighthouse in `a` at its veth address, once it accepts connections."""
        binary = str(Path(sys.executable).parent / "torchft_lighthouse")
        self.start("a", [binary, "--bind", f"{A_ADDR}:{PORT}", "--min_replicas", "2",
                         "--join_timeout_ms", "10000", "--quorum_tick_ms", "10",
                         "--heartbeat_timeout_ms", "500"], log_dir / "lighthouse.log")  # fmt: skip
        probe = (f"import socket,time\nfor _ in range(100):\n    try:\n        "
                 f"socket.create_connection(('{A_ADDR}', {PORT}), 1).close(); break\n"
                 f"    except OSError: time.sleep(0.1)\nelse: raise SystemExit(1)")  # fmt: skip
        r = subprocess.run(["ip", "netns", "exec", self.ns["a"], sys.executable, "-c", probe],
                           timeout=60)  # fmt: skip
        assert r.returncode == 0, (log_dir / "lighthouse.log").read_text()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: torchrun's workers too
            p.wait()
        for ns in self.made:
            # anything still inside was started by one of the processes above
            left = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in left.stdout.split():
                os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], check=False)  # the veth pair goes too


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` (iproute2) to make network namespaces with")
    made = Hosts()
    try:
        made.make()
    except RuntimeError as e:
        made.close()
        pytest.skip(f"cannot make network namespaces here: {e}")
    try:
        made.lighthouse(tmp_path_factory.mktemp("lighthouse"))
        yield made
    finally:
        made.close()


def _equal(a: dict, b: dict) -> None:
    """The groups end bitwise equal: the same reduced gradients, the same state."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _two_hosts(hosts: Hosts, tmp_path: Path, nproc: int) -> None:
    """Group 1 does not commit step 3 (an injected fault), group 0 does: group 1 is behind
    at the next quorum and heals from group 0 across the link, which crosses every address
    a group advertises: the store (the cross-group process group meets there), the
    ManagerServer (the heal's metadata), the HTTP transport (the state) and Gloo's pairs
    (the AllReduce)."""
    fault = {"SHARDTRAIN_FAULT": "0:3:nocommit", "SHARDTRAIN_FAULT_ONCE": str(tmp_path / "once")}
    started = time.monotonic()
    g0 = hosts.group("a", tmp_path, 0, nproc=nproc)
    g1 = hosts.group("b", tmp_path, 1, nproc=nproc, env=fault)
    log0, log1 = finished(g0, timeout=150), finished(g1, timeout=30)
    print(f"{nproc}-rank groups on two hosts: {time.monotonic() - started:.1f} s")
    assert g0.returncode == 0, log0[-3000:]
    assert g1.returncode == 0, log1[-3000:]
    assert "group 1: healed from a live peer at step 3" in log1, log1[-3000:]
    _equal(final_model(tmp_path / "g0"), final_model(tmp_path / "g1"))


def test_one_rank_groups_on_two_hosts(hosts, tmp_path):
    _two_hosts(hosts, tmp_path, nproc=1)


def test_two_rank_groups_on_two_hosts(hosts, tmp_path):
    _two_hosts(hosts, tmp_path, nproc=2)


def _errors(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if ln.startswith("error:")]


def test_an_advertise_host_not_on_this_host_is_refused(hosts, tmp_path):
    """An address no interface of the host has: refused before the group joins anything
    (nothing could ever connect to it), in one line naming it."""
    started = time.monotonic()
    p = hosts.group("b", tmp_path, 1, [f"ft.advertise_host={NOWHERE}"])
    log = finished(p, timeout=120)
    took = time.monotonic() - started
    assert p.returncode == 2, log[-3000:]
    lines = _errors(log)
    assert len(lines) == 1, log[-3000:]
    assert lines[0].startswith(f"error: ft.advertise_host={NOWHERE} is not an address of this host")
    assert "(Cannot assign requested address)" in lines[0]  # the bind that checked it
    assert f"or null for {B_ADDR}, the one routing to ft.lighthouse" in lines[0]
    assert "Traceback" not in log
    print(f"refused in {took:.1f} s (the process's start included)")


def test_an_address_the_peer_cannot_reach_is_named(hosts, tmp_path):
    """Group 0 advertises an address of its host that group 1 has no route to. Its store is
    where rank 0 of every group meets the others (torchft takes the first group by id at
    the newest step), so no step commits: group 1 names the address in one line at each
    step it tries (one every ft.timeout_s) and stops after its ft.stall_timeout_s with one
    error line naming it, instead of waiting without a word. Group 0 names its store too;
    with the longer default budget it is still waiting for a quorum when group 1 stops,
    and is ended by the test."""
    timeouts = ["ft.timeout_s=3"]
    started = time.monotonic()
    g0 = hosts.group("a", tmp_path, 0, [*timeouts, f"ft.advertise_host={UNROUTED}"])
    g1 = hosts.group("b", tmp_path, 1, [*timeouts, "ft.stall_timeout_s=8"])
    log1 = finished(g1, timeout=120)  # a hang guard: it stops ~8 s after its start
    print(f"group 1 stopped {time.monotonic() - started:.1f} s after the groups' start")
    assert g1.returncode == 1, log1[-3000:]
    lines = _errors(log1)
    assert len(lines) == 1, log1[-3000:]
    assert lines[0].startswith("error: ft: no step committed (ConnectionError: the cross-group "
                               f"process group (store {UNROUTED}:"), lines[0]  # fmt: skip
    assert "longer than ft.stall_timeout_s=8" in lines[0], lines[0]
    for log in (log1, finished(g0, timeout=0)):
        named = [ln for ln in log.splitlines() if "did not commit" in ln and UNROUTED in ln]
        assert named, log[-3000:]


# Without namespaces (no root needed): what a group advertises, from this process.


def test_the_advertised_address_is_the_one_routing_to_the_lighthouse():
    from trainer.comm.addresses import AdvertisedHTTPTransport, advertised_host, in_url

    assert advertised_host(None, "http://127.0.0.1:29510") == "127.0.0.1"
    assert advertised_host(None, "127.0.0.1:29510") == "127.0.0.1"  # no scheme
    assert advertised_host("127.0.0.1", "http://127.0.0.1:29510") == "127.0.0.1"
    assert in_url("fd00::2") == "[fd00::2]" and in_url("10.0.0.2") == "10.0.0.2"
    for host, shown in (("127.0.0.1", r"127\.0\.0\.1"), ("::1", r"\[::1\]")):
        transport = AdvertisedHTTPTransport(host, timedelta(seconds=1))
        try:  # the heal's URL, as a peer fetches it
            assert re.fullmatch(rf"http://{shown}:\d+/checkpoint/", transport.address())
        finally:
            transport.shutdown()


def test_an_advertise_host_no_interface_has_is_refused_in_one_line():
    from trainer.comm.addresses import advertised_host
    from trainer.errors import ConfigError

    # TEST-NET-1 (RFC 5737): on no interface; only bound to, never sent to
    with pytest.raises(ConfigError) as e:
        advertised_host("192.0.2.1", "http://127.0.0.1:29510")
    assert str(e.value) == (
        "ft.advertise_host=192.0.2.1 is not an address of this host that other hosts reach "
        "(Cannot assign requested address): give the address of one of its interfaces that "
        "the other replica groups reach, or null for 127.0.0.1, the one routing to "
        "ft.lighthouse"
    )
    with pytest.raises(ConfigError, match=r"^ft.lighthouse=http://:29510: no local address"):
        advertised_host(None, "http://:29510")
