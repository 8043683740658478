"""Chapter 09 exercises: pipeline schedules as data, messages included: 1F1B, and the breadth-first (looped)
schedule that gets the interleaved bubble with AFAB's memory.

Grade your answers with `make grade CH=09`. The grader plays your lists with the chapter's simulator
(`minidist.parallel.pp.schedules.simulate`, which raises on a deadlock or on a compute action whose input never
arrived) and `check_complete`, and checks the chapter's numbers: the bubble fraction (p−1)/(m+p−1) for 1F1B and
(p−1)/(v·m+p−1) for the breadth-first schedule, the step time, the micro-batches in flight per rank (1F1B: at most
min(p−r, m) on rank r, so never more than p), that every message is sent once, after the action that produces it,
and received once. Build the lists yourself: the grader refuses answers that call or import minidist's schedule
builders (`build_schedule`, `afab_order`, `one_f_one_b_order`, `interleaved_order`, `with_communication`,
`forward_only`).

The format (module docstring of minidist/parallel/pp/schedules.py): a schedule is one list of `Action(kind, mb, chunk)`
per rank, run in order. The model is cut into p·v chunks; chunk c lives on rank c mod p (v = 1: chunk r is rank
r's stage). Kinds:

    F / B        forward / backward of micro-batch mb through chunk c
    RECV_F       receive chunk c's input (chunk c−1's output)           needed before F(mb, c) when c > 0
    SEND_F       send chunk c's output to the rank of chunk c+1          after F(mb, c), when c < p·v − 1
    RECV_B       receive the gradient of chunk c's output (from c+1)     needed before B(mb, c) when c < p·v − 1
    SEND_B       send the gradient of chunk c's input to chunk c−1       after B(mb, c), when c > 0

Sends never block; a receive waits until its message has arrived. B(mb, c) also needs F(mb, c) on the same rank.
Import what you need from `minidist.parallel.pp.schedules`: `Action`, and the kind names `F`, `B`, `SEND_F`, `RECV_F`,
`SEND_B`, `RECV_B`. Try `simulate(your_schedule(...), 1.0, 2.0)` and `draw_timeline` while you work.
"""

from minidist.parallel.pp.schedules import Action


def one_f_one_b_schedule(pp: int, microbatches: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush; Narayanan et al. 2021, §2.2.1) for p ranks and m micro-batches, v = 1, with every
    receive and send in place.

    The notebook's `one_f_one_b` (§2) gives each rank's order of ("F", i) and ("B", i): p−r−1 warm-up forwards
    (at most m), then one forward and one backward alternately, then the remaining backwards. Turn it into Actions
    on chunk r and put each message where it belongs: a RECV right before the compute that needs it, a SEND right
    after the compute that produced it. Which ranks have no RECV_F? No SEND_B? Does the last rank receive anything
    for its backwards? Any m >= 1 must work (with m < p the warm-up is shortened to m).

    Think about where a receive must *not* go: a rank that waits for B(i)'s gradient before running the forward
    that its successor is waiting for would deadlock (the simulator raises and names the stuck actions).
    """
    raise NotImplementedError("exercise: the 1F1B order, with RECV before and SEND after each compute action")


def looped_afab_schedule(pp: int, microbatches: int, virtual_stages: int) -> list[list[Action]]:
    """The breadth-first pipeline (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism", MLSys): v chunks per
    rank (chunks r, r+p, ..., r+(v−1)p), every micro-batch through one chunk before the next, forward and backward.

    Rank r runs the forwards of micro-batches 0..m−1 on its first chunk, then on its second, ... then the backwards
    of micro-batches 0..m−1 on its last chunk, then on the one before, ... (messages in place as in 1F1B). For
    m >= p (the grader's cases) the simulator then finds the interleaved schedule's bubble, (p−1)/(v·m+p−1): a
    micro-batch leaving chunk j on rank r comes back to rank r as the input of chunk j+p after p−1 other ranks, and
    while it travels rank r still has m−1 >= p−1 micro-batches to push through chunk j. The price is memory: a rank
    holds every micro-batch of every chunk (m·v units, i.e. the m micro-batches of AFAB) before its first backward,
    and the grader checks that too. And v times the messages of a v = 1 schedule.

    Check on paper for p = 2, m = 2, v = 2 (chunks 0, 2 on rank 0 and 1, 3 on rank 1): write rank 0's list.
    """
    raise NotImplementedError("exercise: all forwards chunk by chunk, then all backwards in reverse chunk order")
