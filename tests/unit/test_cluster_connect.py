"""Joining a cluster that does not answer fails with its name within ``ray.connect_timeout_s`` (``ray.init`` alone
retries an unreachable GCS forever: a notebook cell or a submitted job would hang); one that is still starting
is waited for. No Ray is started here."""

import socket
import threading
import time

import pytest

from unirl_ray.runtime.cluster import RayConfig, dialled_address, ensure_ray, wait_for_cluster


def closed_port() -> int:
    """A port nothing listens on, outside the ephemeral range other processes take ports from meanwhile."""
    from support import free_port

    return free_port()


def test_the_address_ray_dials_is_the_one_probed(monkeypatch):
    from ray._private.services import get_node_ip_address

    assert dialled_address("ray://head.example:10002") == ("head.example", 10002)
    assert dialled_address("ray://head.example") == ("head.example", 10001)
    assert dialled_address("ray://[::1]:10001/ns") == ("::1", 10001)
    assert dialled_address("ray://[::1]") == ("::1", 10001)
    assert dialled_address("10.1.2.3:6379") == ("10.1.2.3", 6379)
    assert dialled_address("127.0.0.1:6379") == (get_node_ip_address(), 6379)  # as ray.init resolves loopback
    assert dialled_address("local") is None
    assert dialled_address("anyscale://my-cluster") is None  # another client scheme: ray.init's own
    monkeypatch.setenv("RAY_ADDRESS", "ray://head.example:10003")  # ray.init reads it for "auto"
    assert dialled_address("auto") == ("head.example", 10003)
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.4:6380")
    assert dialled_address("auto") == ("10.1.2.4", 6380)


def test_an_unreachable_cluster_is_named_within_the_timeout_and_ray_is_not_left_running():
    import ray

    port = closed_port()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"cannot reach the Ray cluster at '127.0.0.1:{port}'.*within 2s"
                                              r".*ray.connect_timeout_s"):
        ensure_ray(RayConfig(address=f"127.0.0.1:{port}", connect_timeout_s=2))
    assert 1.5 < time.monotonic() - t0 < 15
    assert not ray.is_initialized()
    with pytest.raises(ValueError, match="ray.connect_timeout_s must be > 0"):
        RayConfig(connect_timeout_s=0)


def test_a_cluster_still_starting_is_waited_for():
    port = closed_port()
    listening = threading.Event()

    def start_late():
        time.sleep(1.5)
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("0.0.0.0", port))
            server.listen()
            listening.set()
            server.settimeout(20)
            server.accept()[0].close()

    thread = threading.Thread(target=start_late, daemon=True)
    thread.start()
    wait_for_cluster(f"127.0.0.1:{port}", timeout_s=30)
    assert listening.is_set()
    thread.join(timeout=20)
