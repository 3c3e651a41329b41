"""Both ends of one TCP connection name it alike (client ISN, server ISN), whatever was sent
before; two connections are named apart; the socket leaves repair mode untouched."""

from __future__ import annotations

import os
import socket
import time

from smcd_daemon.adapters.tcp_identity import SocketNetns, connection_identity

_TCP_REPAIR = 19


def pair(lsock: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(lsock.getsockname())
    server, _ = lsock.accept()
    return client, server


def test_both_ends_agree_and_connections_differ() -> None:
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        c1, s1 = pair(lsock)
        c2, s2 = pair(lsock)
        try:
            one = connection_identity(c1, active=True)
            assert one is not None, "needs CAP_NET_ADMIN (TCP_REPAIR): run as root"
            assert one == connection_identity(s1, active=False)
            two = connection_identity(c2, active=True)
            assert two == connection_identity(s2, active=False)
            assert two != one
            # data both ways (acked, read, and some left unread) moves no ISN
            c1.sendall(b"x" * 5000)
            s1.sendall(b"y" * 300)
            time.sleep(0.05)
            assert s1.recv(1000) and c1.recv(10)
            assert connection_identity(c1, active=True) == one
            assert connection_identity(s1, active=False) == one
            for sock in (c1, s1):
                assert sock.getsockopt(socket.IPPROTO_TCP, _TCP_REPAIR) == 0
            c1.sendall(b"still a stream")
            assert s1.recv(6000).endswith(b"still a stream")
        finally:
            for sock in (c1, s1, c2, s2):
                sock.close()


def test_so_reuseaddr_survives_and_the_port_can_be_bound_again() -> None:
    """Leaving repair mode clears ``SO_REUSEADDR`` in the kernel; an accepted connection that
    lost it left its server's port unbindable for TIME_WAIT's minute once closed (a server
    restarted on its port got EADDRINUSE under smc-run, and bound at once on TCP). The option
    is as it was after the identity is read, and a new listener binds the port at once after
    the server closed first (its side in TIME_WAIT)."""
    lsock = socket.create_server(("127.0.0.1", 0))  # SO_REUSEADDR, as servers set it
    port = lsock.getsockname()[1]
    client, server = pair(lsock)
    try:
        assert server.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        assert not client.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        assert connection_identity(server, active=False) is not None, "needs CAP_NET_ADMIN"
        assert connection_identity(client, active=True) is not None
        assert server.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        assert not client.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        lsock.close()
        server.close()  # the server's end closes first: TIME_WAIT on its port
        assert client.recv(1) == b""
        client.close()
        again = socket.create_server(("127.0.0.1", port))
        again.close()
    finally:
        for sock in (lsock, client, server):
            sock.close()


def test_a_sockets_namespace_is_the_one_it_was_made_in_and_looked_up_once() -> None:
    ns = SocketNetns()
    here = os.stat("/proc/self/ns/net").st_ino
    with socket.socket() as a, socket.socket() as b:
        assert ns.inode(a) == here
        assert ns._inodes == {a.getsockopt(socket.SOL_SOCKET, 71, 8): here}
        assert ns.inode(b) == here  # the same cookie: no second lookup
        assert len(ns._inodes) == 1
