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


_LATER_PROBE = """
import os, sys, time
from rallypoint._supervise._warm._server import LATER_MODULES
loaded = [m for m in LATER_MODULES if m in sys.modules]
with open(os.path.join(sys.argv[1], "attempts"), "a") as fp:
    fp.write(",".join(loaded) + "\\n")
if len(loaded) < len(LATER_MODULES):
    time.sleep(0.3)
    sys.exit(1)  # again: the next worker is forked a little later
"""


@pytest.mark.timeout(120)
def test_a_worker_forked_later_finds_what_a_first_step_imports_one_piece_at_a_time(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """The first worker starts without waiting for the later imports; each worker forked
    after it finds them done in order, a prefix at a time (a fork asked for meanwhile waits
    for one piece, not for the whole); once they are all done a worker finds them all."""
    import os
    import subprocess
    import sys

    from rallypoint._supervise._warm._server import LATER_MODULES

    script = tmp_path / "probe.py"
    script.write_text(_LATER_PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "1",
         "--max-restarts", "100", "--max-same-failure", "100", str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=100, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [
        line.split(",") if line else [] for line in (tmp_path / "attempts").read_text().splitlines()
    ]
    assert seen[0] == [], seen[0]  # the first worker did not wait for them
    assert seen[-1] == list(LATER_MODULES)
    for loaded in seen:
        assert loaded == list(LATER_MODULES[: len(loaded)]), seen  # in order, a piece at a time
