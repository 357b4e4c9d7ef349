"""SLURM / PET_* detection: pure functions over an env mapping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rallypoint._cli._cluster_env import (
    DEFAULT_RDZV_PORT,
    compress_hostlist,
    detect_cluster_env,
    expand_hostlist,
    parse_slurm,
    parse_tasks_per_node,
    pet_options,
)


@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("gpu5", ["gpu5"]),
        ("a,b , c", ["a", "b", "c"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("n[001-002]x", ["n001x", "n002x"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("host-[3]", ["host-3"]),
        ("c[1,3-4],d[08-09]", ["c1", "c3", "c4", "d08", "d09"]),
    ],
)
def test_expand_hostlist(hostlist: str, expected: list[str]) -> None:
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize(
    ("hostlist", "message"),
    [
        ("", "empty hostlist"),
        ("node[1-2", "unclosed '['"),
        ("node1-2]", "unmatched ']'"),
        ("n[[1]]", "nested '['"),
        ("n[3-1]", "3-1"),
        ("n[a-b]", "expected N or N-M"),
        ("n[]", "empty brackets"),
        ("a,,b", "two commas"),
        ("n[1-999999]", "too large"),
        ("bad host", "whitespace"),
    ],
)
def test_expand_hostlist_rejects(hostlist: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"hostlist|host name") as info:
        expand_hostlist(hostlist)
    assert message in str(info.value)


def test_expand_hostlist_type() -> None:
    with pytest.raises(TypeError, match="must be a str"):
        expand_hostlist(["n1"])  # type: ignore[arg-type]


_prefix = st.text(alphabet="abcxyz-", min_size=1, max_size=5)


@st.composite
def _hostlist_items(draw: st.DrawFn) -> tuple[str, list[str]]:
    prefix = draw(_prefix)
    width = draw(st.integers(min_value=1, max_value=4))
    ranges = draw(
        st.lists(st.tuples(st.integers(0, 500), st.integers(0, 20)), min_size=1, max_size=4)
    )
    bodies = []
    hosts = []
    for lo, span in ranges:
        hi = lo + span
        lo_s = str(lo).zfill(width)
        bodies.append(lo_s if span == 0 else f"{lo_s}-{hi}")
        hosts.extend(prefix + str(n).zfill(width) for n in range(lo, hi + 1))
    suffix = draw(st.sampled_from(["", "-ib", "x"]))
    return f"{prefix}[{','.join(bodies)}]{suffix}", [h + suffix for h in hosts]


@given(st.lists(_hostlist_items(), min_size=1, max_size=4))
def test_expand_hostlist_property(items: list[tuple[str, list[str]]]) -> None:
    text = ",".join(t for t, _ in items)
    expected = [h for _, hs in items for h in hs]
    assert expand_hostlist(text) == expected
    # the compressed form expands back to the same ordered list
    assert expand_hostlist(compress_hostlist(expected)) == expected


_host = st.builds(
    lambda p, n, w: p + (str(n).zfill(w) if n is not None else ""),
    _prefix,
    st.one_of(st.none(), st.integers(0, 120)),
    st.integers(1, 3),
)


@given(st.lists(_host, min_size=1, max_size=30))
def test_compress_roundtrip(hosts: list[str]) -> None:
    compressed = compress_hostlist(hosts)
    assert expand_hostlist(compressed) == hosts


def test_compress_examples() -> None:
    assert compress_hostlist(["n01", "n02", "n03", "n07", "gpu5"]) == "n[01-03,07],gpu5"
    assert compress_hostlist(["a"]) == "a"
    with pytest.raises(ValueError, match="cannot put host name"):
        compress_hostlist(["a,b"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4(x2),3", [4, 4, 3]), ("2", [2]), ("1(x3)", [1, 1, 1]), (" 2 , 1 ", [2, 1])],
)
def test_tasks_per_node(text: str, expected: list[int]) -> None:
    assert parse_tasks_per_node(text) == expected


@pytest.mark.parametrize("text", ["", "x", "4(2)", "0", "4(x0)", "4(x2),"])
def test_tasks_per_node_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="tasks-per-node"):
        parse_tasks_per_node(text)


def _slurm(**over: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "3",
        "SLURM_NNODES": "3",
        "SLURM_NODEID": "2",
        "SLURM_NODELIST": "node[01-02],gpu5",
        "SLURM_TASKS_PER_NODE": "1(x3)",
        "SLURM_STEP_ID": "0",
    }
    env.update(over)
    return {k: v for k, v in env.items() if v != "<unset>"}


def test_slurm_one_agent_per_node() -> None:
    d = detect_cluster_env(_slurm())
    assert d.source == "slurm"
    assert d.nnodes == "3"
    assert d.node_rank == 2
    assert d.nproc_per_node is None
    assert d.rdzv_backend == "c10d"
    assert d.rdzv_endpoint == f"node01:{DEFAULT_RDZV_PORT}"
    assert d.rdzv_id == "slurm-4242.0"
    assert d.slurm is not None and d.slurm.hosts == ("node01", "node02", "gpu5")


def test_slurm_several_tasks_per_node() -> None:
    env = _slurm(
        SLURM_NTASKS="7",
        SLURM_PROCID="5",
        SLURM_NODEID="1",
        SLURM_TASKS_PER_NODE="3,2(x2)",
        SLURM_STEP_ID="<unset>",
    )
    d = detect_cluster_env(env)
    assert (d.nnodes, d.node_rank, d.nproc_per_node) == ("7", 5, "1")
    assert d.rdzv_id == "slurm-4242"
    assert d.slurm is not None and d.slurm.tasks_per_node == (3, 2, 2)


def test_slurm_step_variables_win() -> None:
    env = _slurm(
        SLURM_STEP_NODELIST="gpu[7-8]",
        SLURM_STEP_NUM_NODES="2",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_TASKS_PER_NODE="1(x2)",
        SLURM_NODEID="1",
        SLURM_PROCID="1",
    )
    d = detect_cluster_env(env)
    assert d.rdzv_endpoint == "gpu7:29400"
    assert d.nnodes == "2"


def test_slurm_ntasks_per_node_form() -> None:
    env = _slurm(SLURM_TASKS_PER_NODE="<unset>", SLURM_NTASKS_PER_NODE="1")
    assert detect_cluster_env(env).nnodes == "3"
    env = _slurm(SLURM_TASKS_PER_NODE="<unset>")
    assert detect_cluster_env(env).nnodes == "3"  # derived from NTASKS / NNODES


def test_not_slurm() -> None:
    assert parse_slurm({}) is None
    assert parse_slurm({"SLURM_JOB_ID": "1"}) is None  # sbatch without a task id
    d = detect_cluster_env({"HOME": "/root"})
    assert d.source == "" and d.options() == {}


def test_ignore_slurm() -> None:
    env = _slurm(RALLYPOINT_IGNORE_SLURM="1")
    assert detect_cluster_env(env).source == ""


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"SLURM_NTASKS": "x"}, "SLURM_NTASKS must be an integer, got 'x'"),
        ({"SLURM_NNODES": "0"}, "SLURM_NNODES must be >= 1"),
        ({"SLURM_NODELIST": "n[1-"}, "SLURM_NODELIST: unclosed"),
        ({"SLURM_NODELIST": "a,b"}, "names 2 hosts but the step has 3 nodes"),
        ({"SLURM_TASKS_PER_NODE": "2(x3)"}, "does not describe 3 tasks on 3 nodes"),
        ({"SLURM_TASKS_PER_NODE": "x"}, "SLURM_TASKS_PER_NODE: bad tasks-per-node"),
        ({"SLURM_PROCID": "3"}, "SLURM_PROCID=3 is not below the task count 3"),
        ({"SLURM_NODEID": "5"}, "SLURM_NODEID=5 is not below the node count 3"),
        ({"SLURM_NODELIST": "<unset>"}, "SLURM_NODELIST is not set"),
        ({"SLURM_NODEID": "<unset>"}, "SLURM_NODEID is not set"),
        (
            {"SLURM_TASKS_PER_NODE": "<unset>", "SLURM_NTASKS": "4"},
            "needs SLURM_TASKS_PER_NODE",
        ),
    ],
)
def test_slurm_bad_variables(over: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        detect_cluster_env(_slurm(**over))
    assert message in str(info.value)


def test_pet_options_and_precedence() -> None:
    env = _slurm(
        PET_NNODES="1:4",
        PET_NODE_RANK="0",
        PET_RDZV_ENDPOINT="master:1234",
        PET_MAX_RESTARTS="3",
        PET_MONITOR_INTERVAL="0.5",
    )
    assert pet_options({"PET_NNODES": "2", "PET_": "x", "OTHER": "1"}) == {"nnodes": "2"}
    d = detect_cluster_env(env)
    assert d.source == "slurm+pet"
    assert d.nnodes == "1:4"  # PET_* beats SLURM
    assert d.node_rank == 0
    assert d.max_restarts == 3
    assert d.rdzv_endpoint == "master:1234"
    assert d.rdzv_id == "slurm-4242.0"  # SLURM fills what PET_* leaves out
    assert d.other == {"monitor_interval": "0.5"}
    merged = d.merge({"nnodes": "2", "node_rank": None, "rdzv_id": "mine"})
    assert merged["nnodes"] == "2"  # explicit flag wins
    assert merged["node_rank"] == 0  # None = flag not given
    assert merged["rdzv_id"] == "mine"
    assert merged["monitor_interval"] == "0.5"
    assert merged["rdzv_backend"] == "c10d"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PET_NODE_RANK": "abc"}, "PET_NODE_RANK must be an integer >= 0, got 'abc'"),
        ({"PET_MAX_RESTARTS": "-1"}, "PET_MAX_RESTARTS must be an integer >= 0"),
        ({"PET_RDZV_ENDPOINT": " "}, "PET_RDZV_ENDPOINT is set but empty"),
    ],
)
def test_pet_bad(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        detect_cluster_env(env)
    assert message in str(info.value)
