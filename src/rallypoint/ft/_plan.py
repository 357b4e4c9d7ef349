"""What a decided quorum means for one replica group: who heals from whom, who takes part.

The same computation runs in every group, so every group reaches the same answer without
talking. Members are sorted by replica id. The highest step among them is the step the
quorum trains at; a member below it heals (fetches the state of one at it), and with
``init_sync`` at step 0 every member but one (the primary) does, so that all start from
the same weights. Sources are assigned to the healing members in turn, shifted by the
group rank (a multi-rank group spreads its ranks' transfers over the sources). A healing
member takes part in the step only when it heals before its forward pass (``sync_heal``);
otherwise it sends zeros. The average divides by the members at the top step, as
torchft's does (at step 0 with ``init_sync``, that counts the healers' zeros too).
"""

from __future__ import annotations

from dataclasses import dataclass

from rallypoint.ft._quorum.records import Quorum

__all__ = ["Plan", "plan"]


@dataclass(frozen=True, slots=True)
class Plan:
    round: int
    quorum_id: int
    members: list[str]
    max_step: int
    replica_rank: int
    """This member's rank in the process group across the quorum (every member is in it)."""
    participating_rank: int | None
    participating_size: int
    participants: list[str]
    """Members whose gradients count, which must all commit for anyone to."""
    others: list[str]
    """Healing members that sit this step out."""
    heal: bool
    source_addr: str = ""
    source_replica: str = ""
    source_secret: str = ""
    """The key the source's heal servers accept (empty: the job's ``RALLYPOINT_FT_SECRET``)."""
    serves: bool = False
    """Some member heals from this one."""
    source_rank: int | None = None
    """The source's rank in the process group across the quorum (a transport's ``src_rank``)."""
    dst_ranks: tuple[int, ...] = ()
    """The ranks of the members that heal from this one (a transport's ``dst_ranks``)."""


def plan(quorum: Quorum, member: str, group_rank: int, init_sync: bool, sync_heal: bool) -> Plan:
    members = list(quorum.members)
    ids = [m.member for m in members]
    me = ids.index(member)
    max_step = max(m.step for m in members)
    up = [i for i, m in enumerate(members) if m.step == max_step]
    primary = up[group_rank % len(up)]

    def behind(i: int) -> bool:
        return members[i].step != max_step or (init_sync and max_step == 0 and i != primary)

    healers = [i for i in range(len(members)) if behind(i)]
    sources = [i for i in up if not behind(i)]
    assign = {h: sources[(k + group_rank) % len(sources)] for k, h in enumerate(healers)}
    heal = me in assign
    if sync_heal:
        rank: int | None = me
        size = len(members)
        participants, others = ids, []
    else:  # as torchft counts them: every member at the top step (a healer sends zeros)
        rank = up.index(me) if me in up else None
        size = len(up)
        participants, others = [ids[i] for i in sources], [ids[i] for i in healers]
    source = members[assign[me]] if heal else None
    addr = ""
    if source is not None:
        if group_rank >= len(source.heal):
            raise RuntimeError(
                f"group {source.replica_id} has {len(source.heal)} rank(s); this group's rank "
                f"{group_rank} has no peer to heal from (replica groups must be the same size)"
            )
        addr = source.heal[group_rank]
    return Plan(
        round=quorum.round,
        quorum_id=quorum.quorum_id,
        members=ids,
        max_step=max_step,
        replica_rank=me,
        participating_rank=rank,
        participating_size=size,
        participants=participants,
        others=others,
        heal=heal,
        source_addr=addr,
        source_replica=source.replica_id if source is not None else "",
        source_secret=source.secret if source is not None else "",
        serves=me in assign.values(),
        source_rank=assign[me] if heal else None,
        dst_ranks=tuple(h for h, s in assign.items() if s == me),
    )
