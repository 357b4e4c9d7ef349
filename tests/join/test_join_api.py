"""rallypoint.join's public surface and its answers to bad input."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

import rallypoint.join as rj
from rallypoint.join import (
    CollectiveJoinable,
    Join,
    Joinable,
    JoinHook,
    JoinOptions,
    RankFailedError,
    even_batches,
)
from rallypoint.testing import run_workers


class Good(Joinable):
    def __init__(self, group: Any = None) -> None:
        super().__init__()
        self.group = group

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return JoinHook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.group


class ForgotInit(Good):
    def __init__(self) -> None:  # never calls Joinable.__init__
        self.group = None


class JunkHook(Good):
    def join_hook(self, **kwargs: Any) -> Any:
        return object()


def test_public_names() -> None:
    assert set(rj.__all__) == {
        "CollectiveJoinable",
        "EarlyTerminationError",
        "EvenBatches",
        "Join",
        "JoinError",
        "JoinHook",
        "JoinOptions",
        "JoinSummary",
        "Joinable",
        "RankFailedError",
        "SupportsJoin",
        "even_batches",
    }
    for name in rj.__all__:
        assert getattr(rj, name) is not None
    # torch's names are all there, so code written for torch works by changing the import
    import torch.distributed.algorithms.join as torch_join

    assert set(torch_join.__all__) <= set(rj.__all__)
    assert issubclass(rj.JoinError, RuntimeError)
    assert issubclass(rj.RankFailedError, rj.JoinError)
    assert issubclass(rj.EarlyTerminationError, rj.JoinError)


def test_empty_joinables_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="requires at least one joinable"):
        Join([])


def test_joinables_must_be_a_list() -> None:
    with pytest.raises(TypeError, match="joinables must be a list of joinables, got Good"):
        Join(Good())  # type: ignore[arg-type]


def test_object_without_joinable_interface() -> None:
    with pytest.raises(TypeError, match=r"joinables\[0\] \(object\) is not a joinable: it lacks"):
        Join([object()])  # type: ignore[list-item]


def test_joinable_that_never_called_joinable_init() -> None:
    with pytest.raises(TypeError, match="constructor calls the ``Joinable`` constructor"):
        Join([Good(), ForgotInit()])
    with pytest.raises(TypeError, match="constructor calls the ``Joinable`` constructor"):
        Join.notify_join_context(ForgotInit())


def test_flags_must_be_bools() -> None:
    with pytest.raises(TypeError, match="enable must be a bool, got 1"):
        Join([Good()], enable=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="throw_on_early_termination must be a bool"):
        Join([Good()], throw_on_early_termination="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"join_options must be a rallypoint\.join\.JoinOptions"):
        Join([Good()], join_options={"summary": False})  # type: ignore[arg-type]


def test_join_options_validation() -> None:
    with pytest.raises(TypeError, match=r"poll_interval must be a datetime\.timedelta"):
        JoinOptions(poll_interval=0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="between 1 ms and 60 s"):
        JoinOptions(poll_interval=datetime.timedelta(0))
    with pytest.raises(ValueError, match="warn_threshold must be >= 0"):
        JoinOptions(warn_threshold=-1)
    with pytest.raises(TypeError, match="warn_threshold must be an int"):
        JoinOptions(warn_threshold=True)
    with pytest.raises(TypeError):
        JoinOptions(True)  # type: ignore[misc]


def test_abstract_joinable_cannot_be_instantiated() -> None:
    class Half(Joinable):
        def join_hook(self, **kwargs: Any) -> JoinHook:
            return JoinHook()

    with pytest.raises(TypeError, match="abstract"):
        Half()  # type: ignore[abstract]


def test_collective_joinable_bad_arguments() -> None:
    with pytest.raises(
        TypeError, match=r"process_group must be a torch\.distributed\.ProcessGroup"
    ):
        CollectiveJoinable(process_group="world")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"device must be a torch\.device"):
        CollectiveJoinable(device="not-a-device")
    sync = CollectiveJoinable()
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor, got list"):
        sync.all_reduce([1.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot shadow reduce op"):
        sync.all_reduce(torch.ones(1), op=dist.ReduceOp.AVG)
    with pytest.raises(TypeError, match="needs a floating point tensor"):
        sync.average(torch.ones(2, dtype=torch.int64))
    with sync.iteration(), pytest.raises(RuntimeError, match="cannot be nested"):  # noqa: SIM117
        with sync.iteration():
            pass


def test_even_batches_bad_arguments() -> None:
    with pytest.raises(TypeError, match="needs an iterable with len"):
        even_batches(iter([1, 2]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode must be 'pad' or 'truncate'"):
        even_batches([1], mode="loop")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed\.ProcessGroup"):
        even_batches([1], group="world")  # type: ignore[arg-type]


def _dist_checks() -> dict[str, str]:
    """Checks that need a process group, on two gloo ranks."""
    out: dict[str, str] = {}

    def record(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "no error"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    record("uninitialized", lambda: Join([Good()]))
    record("even_uninitialized", lambda: even_batches([1]))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    other = dist.new_group([0, 1])
    record("mixed_groups", lambda: Join([Good(), Good(other)]))
    record("default_and_none_agree", lambda: Join([Good(None), Good(dist.group.WORLD)]))
    record("junk_hook", lambda: Join([JunkHook()]))
    record("bad_src", lambda: CollectiveJoinable().broadcast(torch.ones(1), src=2))
    record("pad_empty_rank", lambda: list(even_batches([] if rank == 0 else [1, 2])))

    # a rank that joins before one CollectiveJoinable iteration cannot shadow: it fails
    # (publishing its failure) and the other rank hears about it instead of hanging
    scratch = dist.new_group([0, 1])  # left broken by the failure

    def no_inputs_on_rank_0() -> None:
        sync = CollectiveJoinable(process_group=scratch)
        with Join([sync]):
            for _ in range(0 if rank == 0 else 3):
                sync.all_reduce(torch.ones(1))

    record("no_pattern", no_inputs_on_rank_0)

    # Join.iterate misuse
    join = Join([Good()])
    record("iterate_outside", lambda: join.iterate([1]))
    joined = Join([Good()], enable=False)
    with joined:
        record("iterate_disabled", lambda: list(joined.iterate([1, 2])))
        record("iterate_twice", lambda: joined.iterate([1]))
        record("iterate_no_len", lambda: Join.iterate(Join([Good()]).__enter__(), iter([1])))
    scratch2 = dist.new_group([0, 1])

    def break_early() -> None:  # rank 1 leaves iterate() before the common length
        sync = CollectiveJoinable(process_group=scratch2)
        with Join([sync]) as j:
            for step in j.iterate(range(4)):
                if rank == 1 and step == 1:
                    break
                sync.all_reduce(torch.ones(1))

    record("iterate_break", break_early)
    dist.barrier()
    return out


@pytest.mark.timeout(60)
def test_bad_input_that_needs_a_process_group() -> None:
    results = run_workers(_dist_checks, 2, timeout=45)
    for rank, out in enumerate(results):
        assert out["uninitialized"].startswith(
            "RuntimeError: Join needs an initialized process group"
        )
        assert out["even_uninitialized"].startswith(
            "RuntimeError: even_batches needs an initialized process group"
        )
        assert out["mixed_groups"].startswith(
            "ValueError: Using join context manager with multiple process groups: "
            "joinables[0] uses '0' and joinables[1] uses '1'"
        ), out["mixed_groups"]
        assert out["default_and_none_agree"] == "no error"
        assert out["junk_hook"].startswith("TypeError: joinables[0].join_hook() returned object")
        assert out["bad_src"] == "ValueError: src must be a rank in [0, 2), got 2"
        assert out["iterate_outside"].startswith(
            "RuntimeError: Join.iterate() must be called inside the `with join:` block"
        )
        assert out["iterate_disabled"] == "no error"
        assert out["iterate_twice"] == "RuntimeError: Join.iterate() can be called once per context"
        assert out["iterate_no_len"].startswith("TypeError: Join.iterate() needs inputs with len()")
        if rank == 1:
            assert out["iterate_break"].startswith(
                "JoinError: rank 1 left Join.iterate() after 1 inputs, before the 4"
            ), out["iterate_break"]
        else:
            assert out["iterate_break"].startswith(
                "RankFailedError: rank 1 failed inside the Join context: JoinError: rank 1 left"
            ), out["iterate_break"]
        if rank == 0:
            assert out["pad_empty_rank"].startswith("ValueError: rank 0 has no batches")
            assert out["no_pattern"].startswith(
                "JoinError: rank 0 joined before finishing one iteration of CollectiveJoinable"
            )
        else:
            assert out["pad_empty_rank"] == "no error"
            assert out["no_pattern"].startswith(
                "RankFailedError: rank 0 failed inside the Join context: JoinError: rank 0 joined"
            )


def test_rank_failed_error_is_a_runtime_error() -> None:
    assert isinstance(RankFailedError(1, "x", 0), RuntimeError)


def _single_rank() -> tuple[Any, ...]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    sync = CollectiveJoinable()
    with Join([sync]) as join:
        values = [sync.all_reduce(torch.full((2,), 3.0)).tolist() for _ in range(3)]
    dist.destroy_process_group()
    return values, join.summary.shadowed if join.summary else None, join._channel


@pytest.mark.timeout(60)
def test_world_of_one_rank() -> None:
    [(values, shadowed, channel)] = run_workers(_single_rank, 1, timeout=45)
    assert values == [[3.0, 3.0]] * 3
    assert shadowed == (0,)
    assert channel is None  # nobody to tell about a failure
