"""smcd's bus connection survives a full socket buffer.

dbus-fast's writer takes EAGAIN for a dead bus; a burst of signals (hundreds of connections
coming and going at once) then cost smcd its bus name. A real dbus-daemon, a bus socket with a
tiny send buffer and a burst far larger than it: every signal must arrive, the name must stay.
"""

from __future__ import annotations

import asyncio
import socket

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from smcd_daemon.adapters.dbus.bus import connect
from tests.control.dbusd import DbusDaemon

BURST = 3000
PAYLOAD = "x" * 2048


def test_a_burst_larger_than_the_socket_buffer_is_delivered_whole(session_bus: DbusDaemon) -> None:
    async def main() -> None:
        smcd = await connect(session_bus.address)
        listener = await MessageBus(bus_address=session_bus.address).connect()
        got: list[int] = []
        done = asyncio.Event()

        def on_message(msg: Message) -> None:
            if msg.message_type is MessageType.SIGNAL and msg.member == "Burst":
                got.append(msg.body[0])
                if len(got) == BURST:
                    done.set()

        listener.add_message_handler(on_message)
        await listener.call(
            Message(
                destination="org.freedesktop.DBus",
                path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus",
                member="AddMatch",
                signature="s",
                body=["type='signal',member='Burst'"],
            )
        )
        raw = smcd._sock
        assert raw is not None
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        for i in range(BURST):  # no await in between: the buffer fills at once
            smcd.send(Message.new_signal("/org/smcd", "org.smcd.Test", "Burst", "us", [i, PAYLOAD]))
        await asyncio.wait_for(done.wait(), 30)
        assert got == list(range(BURST))
        assert smcd.connected
        reply = await smcd.call(
            Message(
                destination="org.freedesktop.DBus",
                path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus",
                member="GetId",
            )
        )
        assert reply.message_type is MessageType.METHOD_RETURN
        smcd.disconnect()
        listener.disconnect()

    asyncio.run(main())
