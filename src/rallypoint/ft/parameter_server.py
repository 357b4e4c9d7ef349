"""A parameter server on reconfigurable process groups (torchft's prototype): a client's
``GET /new_session`` gets JSON (a session id, a store address under the server's TCPStore),
then both sides configure a group of two ranks there (server 0, client 1) and the server
runs ``forward`` on that request's thread. Nothing received is unpickled; the ports are
open to whoever reaches them, as a TCPStore's is (docs/ft.md)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import urllib.request
import uuid
from abc import ABC, abstractmethod
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rallypoint._core.torch_c import TCPStore
from rallypoint.ft.process_group import ProcessGroup

__all__ = ["ParameterServer"]


class ParameterServer(ABC):
    """Serves sessions; subclasses say what a session does (``forward``) and which process
    group it runs on (``new_process_group``)."""

    def __init__(self, port: int, store_port: int = 0) -> None:
        self.store = TCPStore(
            host_name="0.0.0.0", port=store_port, is_master=True, wait_for_workers=False
        )
        self._server = ThreadingHTTPServer(("", port), self._handler())
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, name="ft-parameter-server", daemon=True
        ).start()

    def address(self) -> str:
        """``http://HOST:PORT/new_session``: where a client asks for a session."""
        return f"http://{socket.gethostname()}:{self._server.server_address[1]}/new_session"

    def shutdown(self) -> None:
        """Stop taking sessions (those under way run on)."""
        self._server.shutdown()
        self._server.server_close()

    @classmethod
    @abstractmethod
    def new_process_group(cls) -> ProcessGroup:
        """A process group not configured yet, for one side of a session."""

    @classmethod
    def new_session(cls, address: str) -> ProcessGroup:
        """Ask the server at ``address`` for a session: the client's process group (rank 1)."""
        with urllib.request.urlopen(address) as answer:
            data = json.loads(answer.read())
        if not isinstance(data, dict) or not isinstance(data.get("store_addr"), str):
            raise ValueError(f"{address}: not a parameter server's answer: {str(data)[:200]}")
        pg = cls.new_process_group()
        pg.configure(data["store_addr"], replica_id="0", rank=1, world_size=2)
        return pg

    @abstractmethod
    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        """Run one session on its own thread: ``pg`` has the server as rank 0 and the client
        as rank 1. When it returns or raises, the session is over."""

    def _session(self, session_id: str, store_addr: str) -> None:
        pg = self.new_process_group()
        pg.configure(store_addr, replica_id="0", rank=0, world_size=2)
        self.forward(session_id, pg)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/new_session":
                    self.send_error(400, f"unknown path {self.path[:100]}: ask /new_session")
                    return
                session_id = str(uuid.uuid4())
                store_addr = f"{socket.gethostname()}:{server.store.port}/session/{session_id}"
                body = json.dumps({"session_id": session_id, "store_addr": store_addr}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                self.close_connection = True
                try:
                    server._session(session_id, store_addr)  # this thread is the session's
                except Exception as exc:  # the session ends; the server serves on
                    sys.stderr.write(
                        f"rallypoint.ft: parameter server session {session_id}: {exc}\n"
                    )

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a line per request would drown the job's output

        return Handler
