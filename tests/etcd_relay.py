"""A TCP relay in front of etcd: cutting it breaks a client's streams as a lost member would.

A client connected through the relay loses its watch streams (and every call
fails) while the relay is cut; a second client connected directly goes on
writing.
"""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["Relay"]


class Relay:
    """A TCP relay to ``target`` on a free loopback port; :meth:`cut` breaks every
    connection through it and refuses new ones until :meth:`restore`."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._refusing = False
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refusing = self._refusing
            if refusing:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            self._refusing = True
            connections, self._open = self._open, []
        for s in connections:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        with self._lock:
            self._refusing = False

    def close(self) -> None:
        self.cut()
        self._listener.close()
