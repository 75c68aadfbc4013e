"""uvicorn's HTTP protocol with TCP_NODELAY on every connection.

With ``--workers`` > 1 uvicorn hands its workers a listening socket that asyncio does not
recognise as TCP, so accepted connections keep Nagle's algorithm on: a keep-alive response
written as headers + body then waits ~40 ms for the client's delayed ACK (measured by
``manage.py bench``: /healthz 47 ms instead of 1-5 ms). Run uvicorn with
``--http zeromem.server:NoDelayH11Protocol``.
"""

import socket

from uvicorn.protocols.http.h11_impl import H11Protocol


class NoDelayH11Protocol(H11Protocol):
    def connection_made(self, transport):
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
