#!/usr/bin/env python3
"""List-scheduling model of the causal dK/dV grids' CTA orders (no GPU needed).

Each CTA (group = (KV head * split, sequence), key block kb) costs the query blocks it sees,
qb_per_kb * (nkb - kb), plus a fixed cost; `slots` CTAs run at once and a freed slot takes the
next CTA in launch order. Prints the makespan over the ideal (total work / slots) for:
  launch  the grid's launch order (key block fastest, groups in turn)
  tailW   plan.cuh bwd_heavy_groups: the last ceil(W * slots / nkb) groups key block slowest
  all     every group key block slowest (DkdvCta on grids of <= 4 waves)
The model knows nothing of L2: on real grids "all" loses the heads' Q / dO sharing (bench/NOTES.md).

usage: cta_order_model.py [slots]
"""
import heapq
import sys


def makespan(order, work, slots):
    free = [0.0] * slots
    end = 0.0
    for cta in order:
        t = heapq.heappop(free) + work[cta]
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def orders(nkb, groups, qb_per_kb, slots, fixed=2):
    work = {(g, kb): qb_per_kb * (nkb - kb) + fixed for g in range(groups) for kb in range(nkb)}
    ideal = sum(work.values()) / slots
    res = {"launch": makespan([(g, kb) for g in range(groups) for kb in range(nkb)], work, slots) / ideal}
    for waves in (1, 2, 3):
        tail = min(groups, -(-waves * slots // nkb))
        order = [(g, kb) for g in range(groups - tail) for kb in range(nkb)]
        order += [(g, kb) for kb in range(nkb) for g in range(groups - tail, groups)]
        res[f"tail{waves}(g={tail})"] = makespan(order, work, slots) / ideal
    res["all"] = makespan([(g, kb) for kb in range(nkb) for g in range(groups)], work, slots) / ideal
    return res


if __name__ == "__main__":
    slots = int(sys.argv[1]) if len(sys.argv) > 1 else 132
    # (name, key blocks per group, groups, query blocks per key block): bf16 B·N = 16384,
    # hidden 2048; d <= 128 tiles take 128 keys and 64 queries, the wide ones 64 and 64
    shapes = [("d128 causal 16k", 128, 16, 2), ("d128 causal 8k", 64, 32, 2), ("d128 causal 4k", 32, 64, 2),
              ("d128 causal 2k", 16, 128, 2), ("d64 causal 16k", 128, 32, 2), ("d256 causal 16k", 256, 8, 1),
              ("d256 causal 4k", 64, 32, 1), ("GQA 4:1 causal 32k", 256, 8, 8)]
    for name, nkb, groups, qpk in shapes:
        print(f"{name:20s} " + " ".join(f"{k}={v:.3f}" for k, v in orders(nkb, groups, qpk, slots).items()))
