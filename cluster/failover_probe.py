#!/usr/bin/env python3
"""Measures a failover: SIGKILLs a node, then hits one actor per shard
through a surviving node, pipelined, every few milliseconds, until every
shard answers OK again. Prints `failover_ms=N errors=N rounds=N`: N ms from
the kill until the last shard answered OK (the first round in which all did).

Used by cluster/bench.sh. The actors are found by asking the node: `PEEK`
answers do not say the shard, so the probe uses many actors (8 per shard on
average) and considers the cluster serving when a whole round answers OK.
"""
import argparse
import os
import signal
import socket
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--node", required=True, help="client address of a surviving node")
    parser.add_argument("--pid", type=int, required=True, help="process to SIGKILL")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds")
    args = parser.parse_args()
    host, port = args.node.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=5)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = conn.makefile("rb")
    actors = args.shards * 8
    batch = b"".join(b"HIT path=/bench user=probe%d\n" % i for i in range(actors))

    def round_trip():
        nonlocal conn, reader
        try:
            conn.sendall(batch)
            answers = [reader.readline() for _ in range(actors)]
        except OSError:
            answers = []
        if len(answers) < actors or any(not a for a in answers):
            # The node closes a connection after an ERR line: reconnect.
            conn.close()
            conn = socket.create_connection((host, int(port)), timeout=5)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader = conn.makefile("rb")
            return False, actors
        errors = sum(1 for a in answers if not a.startswith(b"OK "))
        return errors == 0, errors

    ok, _ = round_trip()
    if not ok:
        print("failover_ms=nan errors=before-kill rounds=0")
        return
    killed = time.monotonic()
    os.kill(args.pid, signal.SIGKILL)
    errors_total = 0
    rounds = 0
    saw_error = False
    while time.monotonic() - killed < args.timeout:
        rounds += 1
        ok, errors = round_trip()
        errors_total += errors
        saw_error = saw_error or errors > 0
        if ok and saw_error:
            break
        if ok and time.monotonic() - killed > 3.0:
            break  # No shard lost its leader (the node led none).
        time.sleep(0.005)
    served = time.monotonic()
    print(f"failover_ms={(served - killed) * 1000:.0f} errors={errors_total} rounds={rounds}")


if __name__ == "__main__":
    main()
