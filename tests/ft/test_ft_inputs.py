"""``rallypoint.ft``'s bad input, each answered with one clear line: an unreachable lighthouse,
a stranger on a heal port, a heal between models of different shapes; and the heal's
typed, pickle-free encoding of a state."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from rallypoint._core.net import free_port
from rallypoint.ft._heal import (
    HealError,
    HealServer,
    decode_skeleton,
    encode_skeleton,
    fetch_state,
)

SECRET = b"a job's secret"


def _state() -> dict[str, object]:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "note": ("a", 1, None)}


def test_a_state_survives_the_typed_encoding() -> None:
    state = _state()
    tensors: list[torch.Tensor] = []
    back = decode_skeleton(encode_skeleton(state, tensors), tensors)
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(back["model"])
    opt = torch.optim.Adam(model.parameters())
    opt.load_state_dict(back["optim"])  # int keys, tuples (betas) and floats come back
    assert back["note"] == ("a", 1, None)
    assert isinstance(back["model"], OrderedDict)
    assert torch.equal(model.weight, state["model"]["weight"])  # type: ignore[index]


def test_what_is_not_state_is_refused_by_path() -> None:
    with pytest.raises(
        HealError, match=r"state\['user'\]\['fn'\]: a builtin_function_or_method cannot be sent"
    ):
        encode_skeleton({"user": {"fn": print}}, [])
    with pytest.raises(ValueError, match="not a heal skeleton node"):
        decode_skeleton({"T": 0, "x": 1}, [])


@pytest.mark.timeout(60)
def test_a_peer_fetches_the_state_and_a_stranger_gets_nothing() -> None:
    server = HealServer(SECRET, host="127.0.0.1", timeout=1.0)
    try:
        state = _state()
        server.allow(7, lambda: state)
        with pytest.raises(HealError, match="secrets differ"):
            fetch_state(f"127.0.0.1:{server.port}", b"not the secret", 7, timeout=5.0)
        with socket.create_connection(("127.0.0.1", server.port)) as stranger:
            stranger.sendall(os.urandom(4096))  # garbage: dropped, the server goes on
        with pytest.raises(HealError, match="no state for step 8"):
            fetch_state(f"127.0.0.1:{server.port}", SECRET, 8, timeout=5.0)
        got, size = fetch_state(f"127.0.0.1:{server.port}", SECRET, 7, timeout=5.0)
        assert size > 0
        assert torch.equal(got["model"]["weight"], state["model"]["weight"])  # type: ignore[index]
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_a_healer_asking_for_a_step_its_source_has_passed_is_told_at_once() -> None:
    server = HealServer(SECRET, host="127.0.0.1", timeout=30.0)  # a wait would take 30 s
    address = f"127.0.0.1:{server.port}"
    failed: list[BaseException] = []

    def fetch() -> None:
        try:
            fetch_state(address, SECRET, 7, timeout=40.0)
        except HealError as exc:
            failed.append(exc)

    try:
        waiting = threading.Thread(target=fetch)
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive()  # step 7 is not served yet: the healer waits for it
        began = time.monotonic()
        server.passed(8)  # the source committed step 7 without serving it
        waiting.join(10)
        assert not waiting.is_alive() and time.monotonic() - began < 5
        assert "no state for step 7" in str(failed[0])
        began = time.monotonic()
        with pytest.raises(HealError, match="no state for step 7"):  # and a later ask too
            fetch_state(address, SECRET, 7, timeout=40.0)
        assert time.monotonic() - began < 5
        server.allow(8, _state)  # the step it is at is served as before
        assert fetch_state(address, SECRET, 8, timeout=5.0)[1] > 0
        server.allow(5, _state)  # a state loaded back to an earlier step
        assert fetch_state(address, SECRET, 5, timeout=5.0)[1] > 0
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_an_unreachable_lighthouse_is_one_line(tmp_path: Path) -> None:
    from rallypoint._core.torch_c import TCPStore

    group = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dead = free_port()
    code = (
        "import rallypoint.ft as torchft\n"
        "from datetime import timedelta\n"
        "torchft.Manager(pg=torchft.ProcessGroupGloo(), load_state_dict=None, state_dict=None,"
        " min_replica_size=1, connect_timeout=timedelta(seconds=2))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "RANK": "0",
           "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(group.port),
           "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{dead}"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100, env=env)  # fmt: skip
    assert done.returncode != 0
    [line] = [x for x in done.stderr.splitlines() if "Unreachable:" in x]
    unreachable = "rallypoint.ft._quorum.client.LighthouseUnreachable: rallypoint.ft: cannot"
    assert line.startswith(f"{unreachable} reach the lighthouse "), line
    assert f"127.0.0.1:{dead}" in line and "TORCHFT_LIGHTHOUSE" in line, line
    env.pop("TORCHFT_LIGHTHOUSE")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100, env=env)  # fmt: skip
    assert done.stderr.strip().splitlines()[-1].endswith("or pass lighthouse_addr"), done.stderr


@pytest.mark.timeout(300)
def test_a_heal_between_models_of_different_shapes_says_so(tmp_path: Path) -> None:
    from _groups import finish, lighthouse, start_group, wait_for_step

    house = lighthouse("--min_replicas", "1", "--join_timeout_ms", "1000")
    try:
        first = start_group(tmp_path, 0, house.address, 10_000)  # alive until the end
        wait_for_step(tmp_path, 0, 5)
        other = start_group(tmp_path, 1, house.address, 30, "--max-restarts", "0", FT_WIDTH="8")
        [text] = finish([other])
        first.terminate()
        finish([first], timeout=60)
    finally:
        house.stop()
    texts = ["", text]
    assert other.returncode != 0
    assert "IncompatibleStateError: the state of group 0 does not fit this group's" in texts[1]
    assert (
        "['0.weight'] is torch.float32 (32, 16) where this group's is torch.float32 (8, 16)"
        in (texts[1])
    ), texts[1][-3000:]
    assert "exited with 122" in texts[1]  # a FatalError: no restart would fit either
