"""An SMC connection given to another process: a child's standard streams, its ``pass_fds``,
``SCM_RIGHTS``, or ``multiprocessing``'s pickling.

inetd- and CGI-style servers run a program per connection with the connection as its standard
streams (``subprocess.Popen(cmd, stdin=conn, stdout=conn)``). An SMC connection's ``fileno()``
is its channel's eventfd, which another process cannot read or write as a stream: it read
nothing and its output vanished. Under smc-run that process gets one end of an ``AF_UNIX``
stream socketpair instead, and a relay process moves the bytes between the other end and the
channel, half-closes included:

- the relay is forked from the caller (the channel's mappings and positions live in the
  process, so only a fork can carry them on) and forks once more, so that it is nobody's child:
  the program never reaps it or sees its exit status;
- it owns the connection from then on (the channel's fork ownership, claimed before the caller
  goes on): the caller's copy raises ``EBUSY`` if it uses it;
- it keeps only that connection's descriptors (the channel's, the daemon's control connection,
  the TCP socket) and the socketpair end, runs none of the program's code (its signal handlers
  are reset, it ends with ``os._exit``), and ends once every holder of the other end has closed
  it and the peer its direction: a child that exits closes the connection as the kernel would
  close a socket it held (EOF for the peer, or a reset when the child left received data
  unread).

One relay serves a connection however it is given and however often (:func:`shared_relay`),
and the caller keeps its end until it closes the connection: the connection ends once the
caller and every process it gave the connection to have closed it, as a TCP socket's does (an
inetd-style parent closes its copy right after starting the child). The ways:

- ``subprocess`` with the connection (or its ``fileno()``) as stdin, stdout or stderr;
- a forked process that ``os.dup2()``s ``fileno()`` onto its standard streams and ``exec``s
  (``http.server``'s CGI handler): ``os.dup2`` copies the relay's socket;
- a program ``exec``ed with ``fileno()`` made inheritable (``os.set_inheritable``), its number
  passed on the command line or in the environment: it finds the relay's socket there;
- ``Popen(..., pass_fds=[conn.fileno()])``, or ``close_fds=False`` with ``fileno()`` made
  inheritable: the child finds the relay's socket at that very number (for the length of
  ``Popen``, the number is moved onto the socket and back; the caller's copy is the relay's
  by then, and uses no descriptor until it is closed);
- ``SCM_RIGHTS`` (``socket.send_fds``, ``multiprocessing``'s handle passing, any ``sendmsg``
  with rights on a Unix socket) and pickling by ``multiprocessing`` (a ``Pool`` task's
  argument, a ``Queue``, a spawned ``Process``'s arguments: it passes a socket's descriptor);
  a send that fails and is tried again sends the same relay.
"""

from __future__ import annotations

import _socket
import array
import contextlib
import errno
import functools
import gc
import os
import select
import socket
import threading
import weakref
from typing import TYPE_CHECKING, Any

from smc_handoff.fdmap import by_fileno, connection_at, copies, copy_of, eventfd_id, is_eventfd
from smc_handoff.socket import SmcSocket

if TYPE_CHECKING:  # smc-run imports this module at start-up: no channel modules then
    from smc_handoff.channel import Channel

__all__ = [
    "connection_of",
    "dup2_source",
    "install",
    "install_pickling",
    "relay_fd",
    "relay_inherited",
    "relay_rights",
    "restore_inherited",
    "shared_relay",
]

#: How often a relay thread waiting for the peer's data looks whether the child is gone.
_GONE_POLL_S = 0.05
_CHUNK = 1 << 16


def connection_of(obj: Any) -> SmcSocket | None:
    """The SMC connection ``obj`` stands for, as ``Popen`` takes a stream: an
    :class:`SmcSocket` on SMC, or the descriptor number its ``fileno()`` returned (or a copy
    of that descriptor, ``os.dup``); else None."""
    if isinstance(obj, SmcSocket):
        return obj if obj.channel is not None else None
    if not isinstance(obj, int) or isinstance(obj, bool) or obj < 0:
        return None
    if not is_eventfd(obj):
        return None
    sock = connection_at(obj)  # the number itself: the index
    if sock is not None and sock._smc is not None and not sock._smc.channel.closed:
        return sock
    if obj in copies:  # a copy smc-run saw made (os.dup, F_DUPFD): checked, no search
        sock = copy_of(obj)
        if sock is not None:
            return sock
    # Rare (a copy made where smc-run did not see it): look through the live sockets rather
    # than keep an index by eventfd id on every handoff's path.
    live = []
    for o in gc.get_objects():
        if isinstance(o, SmcSocket):
            smc = getattr(o, "_smc", None)  # (None in one whose construction failed)
            if smc is not None and not smc.channel.closed:
                if smc.channel.event_fd() == obj:
                    return o
                live.append((o, smc.channel.event_fd()))
    # Another number for the same eventfd (``os.dup(sock.fileno())``): the kernel's id of it.
    ident = eventfd_id(obj)
    if ident is not None:
        for o, fd in live:
            if eventfd_id(fd) == ident:
                return o
    return None


def relay_fd(sock: SmcSocket) -> int:
    """A descriptor a child process can use as ``sock``'s connection: the child's end of a
    socketpair that a relay process serves (see the module docstring). The caller closes it
    once the child has it."""
    smc = sock._smc
    if smc is None:
        raise OSError(errno.EINVAL, "not an SMC connection")
    ch = smc.channel
    keep = {*ch.descriptors(), _socket.socket.fileno(sock)}  # the TCP socket: not our fileno()
    if smc.control is not None:
        keep.add(smc.control.fileno())
    # C sockets: under smc-run the socket module's class is smc-run's own.
    ours, theirs = _socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the intermediate process: start the relay and go
        code = 1
        try:
            os.close(ready_r)
            theirs.close()
            if os.fork() == 0:
                _relay(ch, ours, keep | {ours.fileno(), ready_w}, ready_w)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    ours.close()
    try:
        with contextlib.suppress(ChildProcessError):  # a SIGCHLD handler may have reaped it
            os.waitpid(pid, 0)
        with os.fdopen(ready_r, "rb", buffering=0) as ready:
            said = ready.read(1)
        if said != b"1":
            raise OSError(errno.EIO, "smc-run: the relay process for this connection failed")
    except BaseException:
        theirs.close()
        raise
    return theirs.detach()


def _relay(ch: Channel, child: _socket.socket, keep: set[int], ready_w: int) -> None:
    """The relay process: never returns."""
    import signal

    code = 1
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        with contextlib.suppress(OSError):
            os.setsid()  # not in the program's process group: its terminal's ^C is not ours
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            if fd not in keep:
                os.dup2(devnull, fd)
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd > 2 and fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        ch.claim()
        ch.leave_level_mode()  # blocking calls only: the caller's copy may select on the fd
        os.write(ready_w, b"1")
        os.close(ready_w)
        _pump(ch, child)
        code = 0
    finally:
        os._exit(code)


def _pump(ch: Channel, child: _socket.socket) -> None:
    """Both directions until the child's end is closed and the peer's direction is done, then
    close the connection (``Channel.close``: closed, or an abort when data is unread)."""
    gone = threading.Event()  # the child closed its end entirely (both directions)

    def to_child() -> None:
        buf = memoryview(bytearray(_CHUNK))
        try:
            while not gone.is_set():
                n = ch.recv_into(buf)
                if n:
                    child.sendall(buf[:n])
                elif ch.eof:
                    child.shutdown(socket.SHUT_WR)
                    return
                else:
                    ch.wait_readable(_GONE_POLL_S)
        except OSError:  # a reset from the peer, or the child's end is gone
            with contextlib.suppress(OSError):
                child.shutdown(socket.SHUT_RDWR)

    reader = threading.Thread(target=to_child, name="smc-relay-to-child", daemon=True)
    reader.start()
    buf = memoryview(bytearray(_CHUNK))
    try:
        while n := child.recv_into(buf):
            view = buf[:n]
            while view:
                k = ch.send_into(view)
                view = view[k:]
                if not k:
                    ch.wait_writable(None)
        ch.shutdown_write()  # the child's EOF: a shutdown(SHUT_WR), or its close
        poller = select.poll()
        poller.register(child.fileno(), 0)  # POLLHUP: both directions of its end are closed
        while reader.is_alive() and not poller.poll(int(_GONE_POLL_S * 1000)):
            pass
    except OSError:  # the peer reset, or the child's end failed: abort below if unread
        pass
    gone.set()
    reader.join()
    ch.close()


def install(subprocess: Any) -> None:
    """Make ``subprocess.Popen`` give a child a relay's socket where it is given an SMC
    connection (an object or its ``fileno()``) as stdin, stdout or stderr."""
    popen = subprocess.Popen
    get_handles = getattr(popen, "_get_handles", None)
    if get_handles is None or getattr(get_handles, "_smc_relay", False):
        return
    init = popen.__init__
    # pass_fds's and close_fds's places among the positional arguments (self not counted)
    pass_fds_arg = init.__code__.co_varnames.index("pass_fds") - 1
    close_fds_arg = init.__code__.co_varnames.index("close_fds") - 1

    def smc_get_handles(self: Any, stdin: Any, stdout: Any, stderr: Any) -> Any:
        def swap(stream: Any) -> Any:
            sock = connection_of(stream)
            return stream if sock is None else shared_relay(sock)

        return get_handles(self, swap(stdin), swap(stdout), swap(stderr))

    @functools.wraps(init)
    def smc_init(self: Any, *args: Any, **kwargs: Any) -> None:
        moved: list[tuple[int, int, bool]] = []  # (number, where its eventfd waits, inheritable)
        try:
            pass_fds = kwargs.get("pass_fds", args[pass_fds_arg] if len(args) > pass_fds_arg
                                  else ())  # fmt: skip
            close_fds = kwargs.get("close_fds", args[close_fds_arg] if len(args) > close_fds_arg
                                   else True)  # fmt: skip
            given = list(pass_fds or ())
            if not close_fds:  # every inheritable descriptor goes: an SMC connection's too
                given += [fd for fd in list(by_fileno) if _inheritable(fd)]
            for fd in dict.fromkeys(given):
                sock = connection_of(fd)
                if sock is None:
                    continue
                relay = shared_relay(sock)
                moved.append((fd, os.dup(fd), _inheritable(fd)))
                # Popen makes pass_fds inheritable; with close_fds false, the child inherits it
                _raw_dup2(relay, fd, inheritable=fd not in (pass_fds or ()))
            init(self, *args, **kwargs)
        finally:
            for fd, saved, inheritable in moved:  # the caller's number is its eventfd again
                _raw_dup2(saved, fd, inheritable=inheritable)
                os.close(saved)

    smc_get_handles._smc_relay = True  # type: ignore[attr-defined]
    popen._get_handles = smc_get_handles
    popen.__init__ = smc_init


def _inheritable(fd: int) -> bool:
    try:
        return os.get_inheritable(fd)
    except OSError:
        return False


def _raw_dup2(fd: int, fd2: int, inheritable: bool) -> None:
    """``os.dup2`` as the os module has it, without smc-run's relay (ours move descriptors)."""
    dup2 = getattr(os.dup2, "__wrapped__", os.dup2)
    dup2(fd, fd2, inheritable)


def install_pickling(reduction: Any) -> None:
    """Make ``multiprocessing`` pickle an SMC connection as a relay's socket (``reduction``
    is ``multiprocessing.reduction``, whose socket reducer passes ``fileno()``: the eventfd)."""
    rebuild = getattr(reduction, "_rebuild_socket", None)
    original = getattr(reduction, "_reduce_socket", None)
    if rebuild is None or original is None or getattr(original, "_smc_relay", False):
        return

    def reduce_socket(s: Any) -> Any:
        ch = s.channel if isinstance(s, SmcSocket) else None  # (a pending handoff settles)
        if ch is None or ch.closed:
            return original(s)  # TCP: its own descriptor
        return rebuild, (reduction.DupFd(shared_relay(s)), socket.AF_UNIX, socket.SOCK_STREAM, 0)

    reduce_socket._smc_relay = True  # type: ignore[attr-defined]
    reduction._reduce_socket = reduce_socket
    for cls in {SmcSocket, socket.socket}:  # pickling looks a reducer up by the exact type
        reduction.register(cls, reduce_socket)


_SCM_RIGHTS = (socket.SOL_SOCKET, socket.SCM_RIGHTS)


def shared_relay(sock: SmcSocket) -> int:
    """The relay socket given in place of ``sock``'s connection to other processes, however
    it is given (a child's stream, ``pass_fds``, ``os.dup2``, ``SCM_RIGHTS``, pickling):
    started the first time, then the same; closed with the connection's last close here
    (:attr:`~smc_handoff.handoff.ChannelState.relay`)."""
    smc = sock._smc
    if smc is None:
        raise OSError(errno.EINVAL, "not an SMC connection")
    if smc.relay is None:
        fd = relay_fd(sock)
        smc.relay = fd
        smc.relay_closer = weakref.finalize(smc, _close_quietly, fd)
    return smc.relay


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def relay_rights(ancdata: list[Any]) -> list[Any] | None:
    """``sendmsg`` ancillary data with every SMC connection's ``fileno()`` in an
    ``SCM_RIGHTS`` entry replaced by its :func:`shared_relay`; None when there is none."""
    out: list[Any] = []
    changed = False
    for item in ancdata:
        level, kind, data = item
        if (level, kind) != _SCM_RIGHTS:
            out.append(item)
            continue
        fds = array.array("i")
        raw = memoryview(data).cast("B")
        fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
        swapped = False
        for i, fd in enumerate(fds):
            sock = connection_of(fd)  # (an eventfd of ours, else None at once)
            if sock is not None:
                fds[i] = shared_relay(sock)
                swapped = True
        out.append((level, kind, fds) if swapped else item)
        changed = changed or swapped
    return out if changed else None


def relay_inherited() -> list[tuple[int, int]]:
    """Before ``exec``: put a relay's socket at the number of every SMC connection whose
    ``fileno()`` the program made inheritable (``os.set_inheritable``, to name the number to
    the new program, as inetd-style code passes a TCP socket's), since the program that comes
    cannot use an eventfd as a stream. Returns (number, saved eventfd) pairs for
    :func:`restore_inherited` should the exec fail (the relay owns the connection then: the
    process's copy raises ``EBUSY``; smc-run execs only a file it may execute)."""
    moved: list[tuple[int, int]] = []
    for fd in list(by_fileno):
        try:
            if not os.get_inheritable(fd):
                continue
        except OSError:
            continue
        sock = connection_of(fd)
        if sock is None:
            continue
        relay = shared_relay(sock)
        moved.append((fd, os.dup(fd)))
        _raw_dup2(relay, fd, inheritable=True)
    return moved


def restore_inherited(moved: list[tuple[int, int]]) -> None:
    """The exec failed and the process goes on: each number is its eventfd again."""
    for fd, saved in moved:
        _raw_dup2(saved, fd, inheritable=True)
        os.close(saved)


def dup2_source(fd: int) -> int:
    """What ``os.dup2(fd, ...)`` should copy under smc-run: the connection's
    :func:`shared_relay` when ``fd`` is an SMC connection's ``fileno()`` (the fork-and-exec
    way to give a child the connection); else ``fd``."""
    sock = connection_of(fd)
    return fd if sock is None else shared_relay(sock)
