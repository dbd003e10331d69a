#!/usr/bin/env python3
"""Measures a failover as clients see it: SIGKILLs a node, then sends rounds
of hits, one actor per shard or more (8 actors per shard on average),
through a surviving node, pipelined, back to back. A round is *disturbed*
when an answer is not OK or when it takes much longer than the rounds before
the kill (hits whose shard has no leader wait for the new one instead of
failing, up to --forward-timeout-ms). Prints
`failover_ms=N errors=N slowest_round_ms=N`: N ms from the kill until the
end of the last disturbed round, i.e. until every shard answered again.

Used by cluster/bench.sh.
"""
import argparse
import os
import signal
import socket
import statistics
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--node", required=True, help="client address of a surviving node")
    parser.add_argument("--pid", type=int, required=True, help="process to SIGKILL")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds")
    args = parser.parse_args()
    host, port = args.node.rsplit(":", 1)
    actors = args.shards * 8
    batch = b"".join(b"HIT path=/bench user=probe%d\n" % i for i in range(actors))
    state = {}

    def connect():
        conn = socket.create_connection((host, int(port)), timeout=10)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        state["conn"], state["reader"] = conn, conn.makefile("rb")

    def round_trip():
        """(all answers OK, errors, seconds)."""
        started = time.monotonic()
        try:
            state["conn"].sendall(batch)
            answers = [state["reader"].readline() for _ in range(actors)]
        except OSError:
            answers = []
        took = time.monotonic() - started
        if len(answers) < actors or any(not a for a in answers):
            # The node closes a connection after an ERR line: reconnect.
            state["conn"].close()
            connect()
            return False, actors, took
        errors = sum(1 for a in answers if not a.startswith(b"OK "))
        return errors == 0, errors, took

    connect()
    before = []
    for _ in range(5):
        ok, _, took = round_trip()
        if not ok:
            print("failover_ms=nan errors=before-kill slowest_round_ms=nan")
            return
        before.append(took)
    usual = statistics.median(before)
    slow = max(4 * usual, usual + 0.05)
    killed = time.monotonic()
    os.kill(args.pid, signal.SIGKILL)
    errors_total = 0
    last_disturbed_end = None
    calm_rounds = 0
    slowest = 0.0
    while time.monotonic() - killed < args.timeout:
        ok, errors, took = round_trip()
        errors_total += errors
        slowest = max(slowest, took)
        if not ok or took > slow:
            last_disturbed_end = time.monotonic()
            calm_rounds = 0
        else:
            calm_rounds += 1
        if last_disturbed_end is not None and calm_rounds >= 5:
            break
        if last_disturbed_end is None and time.monotonic() - killed > 3.0:
            break  # Nothing was disturbed: the node led no shard.
    failover = (last_disturbed_end - killed) * 1000 if last_disturbed_end else 0.0
    print(f"failover_ms={failover:.0f} errors={errors_total} slowest_round_ms={slowest * 1000:.0f}")


if __name__ == "__main__":
    main()
