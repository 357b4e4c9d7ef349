"""The warm process's typed replies: errors carry a kind, never text to match."""

from __future__ import annotations

import socket

import pytest

from rallypoint._supervise._warm._messages import Exited, Failed, StoreStarted, decode, recv, send
from rallypoint._supervise._warm._process import WarmProcess
from rallypoint.launcher import WarmErrorKind, WarmProcessError


def test_messages_travel_as_typed_dataclasses() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        for msg in (Exited(5, 256), Failed(WarmErrorKind.STORE, "x"), StoreStarted(1, 2)):
            send(a, msg)
            assert recv(b) == (msg, [])
        a.close()
        assert recv(b) == (None, [])
    with pytest.raises(AssertionError, match="not a warm-process message"):
        decode(b"\x80\x04K\x05.")  # a pickled 5


@pytest.mark.timeout(60)
def test_error_kinds() -> None:
    warm = WarmProcess.fork(import_torch=False)
    try:
        with pytest.raises(WarmProcessError) as info:
            warm.init(("no_such_module_xyz",))
        assert info.value.kind is WarmErrorKind.PRELOAD
        assert "no_such_module_xyz" in str(info.value)
        warm.init(())
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            with pytest.raises(WarmProcessError) as info:
                warm.start_store("127.0.0.1", port)
        assert info.value.kind is WarmErrorKind.PORT_IN_USE
        bound, store_pid = warm.start_store("127.0.0.1", 0)
        assert bound > 0 and store_pid > 0
        assert warm.reset_store() == bound
    finally:
        warm.close()
    with pytest.raises(WarmProcessError) as info:
        warm.start_store("127.0.0.1", 0)
    assert info.value.kind is WarmErrorKind.DIED
