"""Pure parts of rallypoint.snapshot: the state's flattening, the slot format, which slot a
write takes, the agreement on a real TCPStore (threads as ranks), options and bad input."""

from __future__ import annotations

import pickle
import threading
from collections import OrderedDict
from datetime import timedelta
from typing import Any

import pytest
import torch

from rallypoint._snapshot._agree import Agreement, next_generation, parse_where
from rallypoint._snapshot._flatten import apply, flatten
from rallypoint._snapshot._layout import (
    HEADER_SIZE,
    encode_meta,
    plan,
    read_meta,
    views,
    write_meta,
)
from rallypoint._snapshot._layout import Meta as SnapMeta
from rallypoint._snapshot._options import Options
from rallypoint._snapshot._records import Records, SlotState
from rallypoint._snapshot._snapshot_dir import Checkpoint


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _roundtrip(state: dict[str, Any], target: dict[str, Any]) -> list[str]:
    """save -> slot bytes -> restore, as the node session does it."""
    flat = flatten(state)
    entries, end = plan(flat.tensors, flat.paths)
    blob = encode_meta(SnapMeta(0, 1, "g", 3, flat.skeleton, entries))
    buf = bytearray(end + len(blob))
    base = torch.frombuffer(buf, dtype=torch.uint8)
    for src, dst in zip(flat.tensors, views(base, entries), strict=True):
        dst.copy_(src)
    write_meta(memoryview(buf), end, blob)
    meta = read_meta(memoryview(buf))
    return apply(target, meta.skeleton, views(base, meta.entries), [e.device for e in meta.entries])


def test_model_optimizer_tensor_and_values_come_back_in_place() -> None:
    model, opt = _model_and_optimizer(0)
    counter = torch.arange(3.0)
    state = {"model": model, "optimizer": opt, "t": counter, "epoch": {"n": 7, "ids": [1, 2]}}
    model2, opt2 = _model_and_optimizer(1)
    live = torch.zeros(3)
    target: dict[str, Any] = {"model": model2, "optimizer": opt2, "t": live, "epoch": None}
    assert _roundtrip(state, target) == []
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert target["t"] is live and torch.equal(live, counter)  # copied into the same tensor
    assert target["epoch"] == {"n": 7, "ids": [1, 2]}
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert torch.equal(s1[0]["exp_avg"], s2[0]["exp_avg"])
    # the optimizer keeps private copies, never the shared slot's memory
    mine = opt2.state[next(iter(model2.parameters()))]["exp_avg"]
    assert mine.untyped_storage().nbytes() == mine.nbytes


def test_an_optimizer_with_state_gets_it_back_in_its_own_tensors() -> None:
    model, opt = _model_and_optimizer(0)
    model2, opt2 = _model_and_optimizer(1)
    before = [t for st in opt2.state.values() for t in st.values()]
    _roundtrip({"model": model, "optimizer": opt}, {"model": model2, "optimizer": opt2})
    after = [t for st in opt2.state.values() for t in st.values()]
    assert all(a is b for a, b in zip(before, after, strict=True))  # no new allocation
    for a, b in zip(opt.state.values(), opt2.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_tied_tensors_stay_tied_and_metadata_survives() -> None:
    w = torch.randn(3, 3)
    sd = OrderedDict(a=w, b=w)
    sd._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]

    class Holder:
        def __init__(self) -> None:
            self.got: Any = None

        def state_dict(self) -> Any:
            return sd

        def load_state_dict(self, value: Any) -> None:
            self.got = value

    flat = flatten({"h": Holder()})
    assert len(flat.tensors) == 1 and flat.paths == ["h/a"]
    target = Holder()
    _roundtrip({"h": Holder()}, {"h": target})
    assert target.got["a"] is target.got["b"] and torch.equal(target.got["a"], w)
    assert target.got._metadata == {"": {"version": 2}}


def test_mismatches_are_noted_not_raised() -> None:
    notes = _roundtrip({"t": torch.ones(2), "x": 1}, {"t": torch.zeros(5), "y": 2})
    assert any("shape or dtype differs" in n for n in notes)
    assert any("not in the snapshot" in n and "y" in n for n in notes)


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([1, 2], TypeError, "state must be a dict"),
        ({1: torch.ones(1)}, TypeError, "keys must be str"),
        ({"lock": threading.Lock()}, TypeError, r"state\['lock'\] cannot be pickled"),
    ],
)
def test_flatten_rejects_bad_states(state: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        flatten(state)


def test_a_state_dict_that_is_not_a_dict_is_a_type_error() -> None:
    class Bad:
        def state_dict(self) -> int:
            return 3

    with pytest.raises(TypeError, match=r"state\['b'\].state_dict\(\) returned int"):
        flatten({"b": Bad()})


def test_layout_is_aligned_and_a_bad_header_is_refused() -> None:
    entries, end = plan([torch.ones(3, dtype=torch.float16), torch.ones(5)], ["a", "b"])
    assert [e.offset for e in entries] == [HEADER_SIZE, HEADER_SIZE + 64]
    assert end == HEADER_SIZE + 128
    with pytest.raises(ValueError, match="bad header"):
        read_meta(b"\0" * 100)
    with pytest.raises(ValueError, match="too short"):
        read_meta(b"x")


def test_slot_choice_keeps_the_restore_point_and_never_three_copies() -> None:
    records = Records()
    slot = records.begin(0, 2, ("g1", 36), 100, None)
    assert records.commit(0, ("g1", 36), slot.index)
    slot = records.begin(0, 2, ("g1", 37), 100, ("g1", 36))
    assert records.commit(0, ("g1", 37), slot.index)
    # a restore went back to (g1, 36); the new generation's 37 must not overwrite it
    slot = records.begin(0, 2, ("g2", 37), 100, ("g1", 36))
    assert records.find(0, 2, ("g1", 36)) is not None
    assert records.find(0, 2, ("g1", 37)) is None and slot.state is SlotState.WRITING
    # an unfinished write is never listed; committing another key than the slot's fails
    assert not records.commit(0, ("g2", 38), slot.index)
    assert [r["step"] for r in records.inventory()] == [36]
    records.abort(slot)
    assert records.held_bytes() == 2 * 4096
    # another world's record of the same rank is useless: dropped on restore
    records.begin(1, 4, ("g3", 1), 10, None)
    records.restored(0, 2, ("g1", 36))
    assert {r["world"] for r in records.inventory()} == {2}


def test_prune_keeps_only_this_nodes_and_its_upstreams_ranks() -> None:
    records = Records()
    for rank, world in ((0, 4), (1, 4), (2, 4), (3, 4), (5, 8)):
        records.commit(rank, ("g", 1), records.begin(rank, world, ("g", 1), 10, None).index)
    records.prune(4, {0, 1, 3})
    assert sorted((r["rank"], r["world"]) for r in records.inventory()) == [(0, 4), (1, 4), (3, 4)]
    assert records.held_bytes() == 3 * 4096  # the dropped slots' memory is released


def test_a_pinned_slot_makes_a_write_wait() -> None:
    records = Records()
    for step in (1, 2):
        slot = records.begin(0, 1, ("g", step), 10, ("g", step - 1))
        records.commit(0, ("g", step), slot.index)
    pinned = records.pin(0, 1, ("g", 1))
    assert pinned is not None
    done = threading.Event()

    def write() -> None:
        records.begin(0, 1, ("g", 3), 10, ("g", 2))
        done.set()

    threading.Thread(target=write, daemon=True).start()
    assert not done.wait(0.2)
    records.unpin(pinned)
    assert done.wait(5)


def _ranks(world: int, fn: Any) -> list[Any]:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out: list[Any] = [None] * world

    def run(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
        agree = Agreement(
            client,
            rank=rank,
            world=world,
            group_rank=rank // 2,
            group_world=(world + 1) // 2,
            timeout=timedelta(seconds=20),
        )
        out[rank] = fn(rank, agree)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.timeout(60)
def test_agreement_picks_the_newest_step_every_rank_has() -> None:
    # node 0 (ranks 0, 1) holds 36 and 37 of its ranks and 36 of ranks 2, 3 (their replica);
    # node 1 was replaced: its server has nothing. Rank 1 also has a 4-rank world's step 50.
    own = [(0, 4, ("a", 36)), (0, 4, ("a", 37)), (1, 4, ("a", 36)), (1, 4, ("a", 37))]
    held = {0: [*own, (2, 4, ("a", 36)), (3, 4, ("a", 36)), (1, 2, ("z", 50))], 1: []}

    def choose(rank: int, agree: Agreement) -> Any:
        server = f"node{rank // 2}"
        inventory = (lambda: held[rank // 2]) if rank % 2 == 0 else None
        d30, d36 = Checkpoint(30, "run-a/step-30"), Checkpoint(36, "run-a/step-36")
        return agree.choose(
            0, inventory=inventory, server=server, disk=[d30, d36] if rank else [d36]
        )

    choices = _ranks(4, choose)
    assert {c.memory for c in choices} == {("a", 36)}
    assert choices[0].holders == ["node0"] and choices[3].holders == ["node0"]
    assert all(c.disk == [Checkpoint(36, "run-a/step-36")] for c in choices)
    assert choices[1].other_worlds == {2}


@pytest.mark.timeout(60)
def test_save_done_waits_for_every_rank() -> None:
    def save(rank: int, agree: Agreement) -> float:
        import time

        time.sleep(1.0 * rank)
        agree.save_done(("g", 1))
        return time.monotonic()

    ends = _ranks(3, save)
    assert max(ends) - min(ends) < 1.0  # all released together by the last one (not 2 s apart)


def test_generations_are_ordered_and_where_lines_parse() -> None:
    a = next_generation(None)
    b = next_generation(a)
    assert a.startswith("0.") and b.startswith("1.")
    holders = parse_where("4 0.ab 36 h:1\nbad line\n2 1.cd -1 h:2\n")
    assert [(h.world, h.key, h.addr) for h in holders] == [
        (4, ("0.ab", 36), "h:1"),
        (2, ("1.cd", -1), "h:2"),
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every": 0}, ValueError, "every must be >= 1"),
        ({"every": 2.5}, TypeError, "every must be an int"),
        ({"every": True}, TypeError, "every must be an int"),
        ({"timeout": -1}, ValueError, "timeout must be > 0"),
        ({"timeout": "soon"}, TypeError, "timeout must be seconds"),
        ({"timeout": float("inf")}, ValueError, "finite"),
        ({"dir": 3}, TypeError, "dir must be a path"),
        ({"dir": ""}, ValueError, "non-empty"),
    ],
)
def test_options_reject_bad_values(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Options().update(**kwargs)


def test_options_from_env() -> None:
    assert Options.from_env({}).dir is None
    opts = Options.from_env({"RALLYPOINT_SNAPSHOT_DIR": "/x", "RALLYPOINT_SNAPSHOT_EVERY": "5"})
    assert (opts.dir, opts.every) == ("/x", 5)
    with pytest.raises(ValueError, match="RALLYPOINT_SNAPSHOT_EVERY must be an integer"):
        Options.from_env({"RALLYPOINT_SNAPSHOT_EVERY": "often"})
    assert Options().update(timeout=timedelta(seconds=3)).timeout == 3.0


def test_meta_pickles() -> None:
    meta = SnapMeta(0, 1, "g", 1, b"", ())
    assert pickle.loads(pickle.dumps(meta)) == meta
