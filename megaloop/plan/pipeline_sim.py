"""Pipeline-schedule simulator: megatron-core's 1F1B and interleaved 1F1B, op by op.

Each pipeline rank runs a *program* that mirrors megatron's schedule code (``schedules.py`` of
megatron-core 0.16, non-overlapped p2p): compute ops ``F``/``B`` of (microbatch, model chunk) and
blocking communication steps (``send_forward_recv_backward`` and the like). A message on a ring
link (rank k -> k±1 mod pp, per direction) completes when both the sender and the receiver have
posted it, plus its transfer time; a communication step ends when all of its messages have (a
rendezvous, as NCCL send/recv on the GPU stream and gloo's blocking requests behave). Compute ops
take the durations a cost function gives, so microbatches of different depths cost different
times on each virtual stage; transfers take a constant, a per-link or (replaying a measured run) a
per-message time. Times are in seconds (any unit works).

Virtual stage of chunk ``c`` on rank ``k`` is ``c * pp + k`` (megaloop's LoopedGPT convention).
Bubble fraction = 1 - (sum of compute time over ranks) / (pp * makespan): the textbook
``(p-1)/(m+p-1)`` for equal costs under 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

# A program item: ("F" | "B", microbatch, chunk) or ("X", sends, recvs) with sends/recvs lists of
# (direction "f" | "b", peer rank).
Item = tuple


@dataclass
class SimResult:
    """Outcome of one simulated schedule (seconds)."""

    makespan: float
    busy: list[float]  # compute time per pipeline rank
    end: list[float]  # time each rank finished its last item
    trace: list[list[tuple[str, int, int, float, float]]] = field(repr=False)  # per rank (kind, mb, chunk, t0, t1)

    @property
    def bubble(self) -> float:
        """Idle share of the pipeline: 1 - sum(busy) / (pp * makespan)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def imbalance(self) -> float:
        """The part of the bubble no schedule removes: 1 - mean(busy) / max(busy) (unequal work
        per rank; the rest is fill/drain and waiting on microbatches of unequal cost)."""
        top = max(self.busy) if self.busy else 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * top) if top > 0 else 0.0


def schedule_table(m: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """megatron's ``get_schedule_table``: virtual microbatch id -> (microbatch, chunk)."""
    table: list[tuple[int, int]] = []
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        table.extend((mb, c) for c in range(vpp) for mb in range(lo, hi))
    return table


def program_1f1b(pp: int, m: int, rank: int) -> list[Item]:
    """Non-interleaved 1F1B program of ``rank`` (``forward_backward_pipelining_without_interleaving``)."""
    first, last = rank == 0, rank == pp - 1
    prev, nxt = rank - 1, rank + 1

    def comm(send_f=False, recv_f=False, send_b=False, recv_b=False) -> Item:
        sends = ([("f", nxt)] if send_f and not last else []) + ([("b", prev)] if send_b and not first else [])
        recvs = ([("f", prev)] if recv_f and not first else []) + ([("b", nxt)] if recv_b and not last else [])
        return ("X", sends, recvs)

    warm = min(pp - rank - 1, m)
    rest = m - warm
    prog: list[Item] = []
    for i in range(warm):
        prog += [comm(recv_f=True), ("F", i, 0), comm(send_f=True)]
    if rest > 0:
        prog.append(comm(recv_f=True))
    for i in range(rest):
        prog += [("F", warm + i, 0), comm(send_f=True, recv_b=True), ("B", i, 0)]
        prog.append(comm(send_b=True) if i == rest - 1 else comm(send_b=True, recv_f=True))
    for i in range(warm):
        prog += [comm(recv_b=True), ("B", rest + i, 0), comm(send_b=True)]
    return prog


def program_interleaved(pp: int, vpp: int, m: int, rank: int, group: int | None = None) -> list[Item]:
    """Interleaved 1F1B program of ``rank`` (``forward_backward_pipelining_with_interleaving``,
    ``overlap_p2p_comm=False``); ``group`` = microbatch_group_size_per_vp_stage (default pp)."""
    group = group or pp
    total = m * vpp
    table = schedule_table(m, vpp, group)
    first, last = rank == 0, rank == pp - 1
    nxt, prev = (rank + 1) % pp, (rank - 1) % pp

    def chunk(j: int, forward: bool) -> int:
        c = table[j % total][1]
        return c if forward else vpp - 1 - c

    def recv_flag(j: int, forward: bool) -> bool:
        """megatron's ``recv_tensor_from_previous_stage``: does a tensor for the next op arrive?"""
        leading = first if forward else last
        if not leading:
            return True
        if j < pp - 1:
            return False
        nc = chunk(j - (pp - 1), forward)
        return nc != ((vpp - 1) if forward else 0)

    def comm(send_f=False, recv_f=False, send_b=False, recv_b=False) -> Item:
        sends = ([("f", nxt)] if send_f else []) + ([("b", prev)] if send_b else [])
        recvs = ([("f", prev)] if recv_f else []) + ([("b", nxt)] if recv_b else [])
        return ("X", sends, recvs)

    warm = (pp - rank - 1) * 2 + (vpp - 1) * group
    all_warm = warm >= total
    warm = min(warm, total)
    rest = total - warm
    f_count = [0] * vpp  # forwards issued per chunk (their microbatches, in order)
    f_mbs: list[list[int]] = [[] for _ in range(vpp)]
    b_count = [0] * vpp

    def fwd(j: int) -> Item:
        c = chunk(j, True)
        mb = table[j][0]
        f_mbs[c].append(mb)
        f_count[c] += 1
        return ("F", mb, c)

    def bwd(j: int) -> Item:
        c = chunk(j, False)
        mb = f_mbs[c][b_count[c]]  # backward pops the chunk's oldest forward
        b_count[c] += 1
        return ("B", mb, c)

    prog: list[Item] = [comm(recv_f=not first)]
    for k in range(warm):
        c = chunk(k, True)
        recv_prev = recv_flag(k, True) and k != total - 1
        prog.append(fwd(k))
        send = not (c == vpp - 1 and last)
        if k == warm - 1 and not all_warm:
            prog.append(comm(send_f=send, recv_f=recv_prev, recv_b=not last))
        else:
            prog.append(comm(send_f=send, recv_f=recv_prev))
    for k in range(rest):
        fk = k + warm
        cf, cb = chunk(fk, True), chunk(k, False)
        prog += [fwd(fk), bwd(k)]
        recv_prev = recv_flag(fk, True) and k != rest - 1
        prog.append(comm(send_f=not (cf == vpp - 1 and last), recv_f=recv_prev,
                         send_b=not (cb == 0 and first), recv_b=recv_flag(k, False)))
    if all_warm:
        prog.append(comm(recv_b=not last))
    for k in range(rest, total):
        cb = chunk(k, False)
        recv_next = recv_flag(k, False) and k != total - 1
        prog.append(bwd(k))
        prog.append(comm(send_b=not (cb == 0 and first), recv_b=recv_next))
    return prog


@lru_cache(maxsize=256)
def programs(pp: int, m: int, vpp: int = 1) -> tuple[tuple[Item, ...], ...]:
    """Programs of all pipeline ranks: 1F1B (``vpp == 1``) or interleaved (cached; do not mutate)."""
    if pp < 1 or m < 1 or vpp < 1:
        raise ValueError(f"pp, m and vpp must be >= 1, got pp={pp} m={m} vpp={vpp}")
    if vpp == 1:
        return tuple(tuple(program_1f1b(pp, m, k)) for k in range(pp))
    return tuple(tuple(program_interleaved(pp, vpp, m, k)) for k in range(pp))


@lru_cache(maxsize=256)
def _compiled(pp: int, m: int, vpp: int) -> tuple:
    """The programs with each communication step's messages resolved once: per message its link
    (direction, src, dst) and its index on that link (the n-th send of ``src``, the n-th receive
    of ``dst``: fixed by program order, since only the sender posts sends on a link and only the
    receiver receives). Compute items stay ``(kind, mb, chunk)``; a step is ``("X", messages)``."""
    links: dict[tuple[str, int, int], int] = {}
    out = []
    for k, prog in enumerate(programs(pp, m, vpp)):
        count: dict[tuple[int, bool], int] = {}
        items = []
        for item in prog:
            if item[0] != "X":
                items.append(item)
                continue
            msgs = []
            for box, is_send in ((item[1], True), (item[2], False)):
                for d, peer in box:
                    key = (d, k, peer) if is_send else (d, peer, k)
                    lid = links.setdefault(key, len(links))
                    i = count.get((lid, is_send), 0)
                    count[(lid, is_send)] = i + 1
                    msgs.append((lid, i, is_send, key))
            items.append(("X", tuple(msgs)))
        out.append(tuple(items))
    return tuple(out), len(links)


def simulate(pp: int, m: int, cost: Callable[[str, int, int], float], *, vpp: int = 1,
             transfer: float | Callable[..., float] = 0.0, eager_sends: bool = False,
             per_message: bool = False) -> SimResult:
    """Run the schedule. ``cost(kind, microbatch, virtual_stage)`` -> compute seconds of ``F``/``B``;
    ``transfer`` -> seconds per message, or ``transfer(direction, src_rank, dst_rank)``, or with
    ``per_message`` ``transfer(direction, src_rank, dst_rank, n, is_send)`` for the n-th message on
    that link as seen by its sender / receiver (replays of measured runs).
    ``eager_sends``: a send completes ``transfer`` after it is posted whether or not the receiver
    has posted (buffered transports); default: rendezvous."""
    progs, n_links = _compiled(pp, m, vpp)
    const = None
    if not callable(transfer):
        const = float(transfer)
        xfer = None
    elif per_message:
        xfer = transfer
    else:
        xfer = (lambda d, s, t, i, snd, f=transfer: f(d, s, t))
    pc = [0] * pp  # next item per rank
    now = [0.0] * pp
    busy = [0.0] * pp
    trace: list[list[tuple[str, int, int, float, float]]] = [[] for _ in range(pp)]
    sent: list[list[float]] = [[] for _ in range(n_links)]  # per link: post times of its sends, in order
    recvd: list[list[float]] = [[] for _ in range(n_links)]
    posted = [False] * pp  # current comm item of the rank has been posted
    lengths = [len(p) for p in progs]
    remaining = sum(lengths)
    while remaining:
        progressed = False
        for k in range(pp):
            prog, n_k, t = progs[k], lengths[k], now[k]
            tr = trace[k]
            while pc[k] < n_k:
                item = prog[pc[k]]
                if item[0] != "X":
                    kind, mb, c = item
                    dt = float(cost(kind, mb, c * pp + k))
                    tr.append((kind, mb, c, t, t + dt))
                    t += dt
                    busy[k] += dt
                else:
                    msgs = item[1]
                    if not posted[k]:  # post every message of the step at the rank's current time
                        for lid, _i, is_send, _key in msgs:
                            (sent if is_send else recvd)[lid].append(t)
                        posted[k] = True
                    done = t
                    ready = True
                    for lid, i, is_send, key in msgs:
                        s = sent[lid]
                        if eager_sends and is_send:
                            done = max(done, s[i] + (const if xfer is None else xfer(key[0], key[1], key[2], i, True)))
                            continue
                        r = recvd[lid]
                        if len(s) <= i or len(r) <= i:
                            ready = False
                            break
                        a, b = s[i], r[i]
                        done = max(done, (a if a > b else b)
                                   + (const if xfer is None else xfer(key[0], key[1], key[2], i, is_send)))
                    if not ready:
                        break
                    t = done
                    posted[k] = False
                pc[k] += 1
                remaining -= 1
                progressed = True
            now[k] = t
        if not progressed:
            stuck = {k: programs(pp, m, vpp)[k][pc[k]] for k in range(pp) if pc[k] < lengths[k]}
            raise RuntimeError(f"pipeline simulation deadlocked (pp={pp}, vpp={vpp}, m={m}): {stuck}")
    return SimResult(makespan=max(now), busy=busy, end=list(now), trace=trace)


@lru_cache(maxsize=256)
def inflight_order(pp: int, m: int, vpp: int = 1) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per rank, its compute ops in program order: ``(kind, microbatch, chunk)``. Activations of
    (microbatch, chunk) are held from its ``F`` to its ``B``."""
    return tuple(tuple(it for it in prog if it[0] in ("F", "B")) for prog in programs(pp, m, vpp))


def textbook_bubble(pp: int, m: int, vpp: int = 1) -> float:
    """Equal-cost bubble: (p-1)/(m+p-1) for 1F1B, (p-1)/(v·m+p-1) interleaved (Narayanan et al.)."""
    return (pp - 1) / (vpp * m + pp - 1)
