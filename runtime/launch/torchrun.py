"""`torchrun` whose rendezvous store listens on --master-addr alone (what `dsv4 node start` runs).

On node 0, torchrun's agent hosts the store every rank of the service joins (a TCPStore, torchrun's
"static" rendezvous); left to itself it listens on every interface (`*:PORT`), whatever address
--master-addr names. This is torchrun with one change: on node 0 that store is made first,
listening on the master address only (`runtime.launch.rank_store.bound_store`), as a
multi-tenant server, which torchrun's own multi-tenant store of the same port then shares.
Everything else — the arguments, the agent, its workers — is torchrun's (`torch.distributed.run`),
but for how a failure is said: one line naming the rank that failed first, its host, pid and exit
status or signal (`torchrun: rank 1 on host-b (pid 4242) killed by SIGKILL`), where torchrun
prints its own traceback and a footer (`traceback : To enable traceback see: …`). The rank's own
words are in its lines above (`dsv4 node supervise` reads them for the node's ending).

    python -m runtime.launch.torchrun <torchrun's arguments>
"""

from __future__ import annotations

import socket
import sys

STORE_TIMEOUT_S = 900.0  # torchrun's static rendezvous default
SAID = "torchrun: "  # the prefix of the line saying which rank failed first


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = run.parse_args(list(sys.argv[1:] if argv is None else argv))
    store = None
    if args.rdzv_backend == "static" and args.node_rank == 0:
        from runtime.launch.rank_store import bound_store

        store = bound_store(args.master_addr, args.master_port, STORE_TIMEOUT_S, multi_tenant=True)
    try:
        run.run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(SAID + failure_line(rank, failure.pid, failure.exitcode, len(e.failures) - 1), file=sys.stderr,
              flush=True)
        sys.exit(1)
    finally:
        del store  # held until the agent is done: torchrun's store is this one


def failure_line(rank: int, pid: int, code: int, others: int) -> str:
    """`rank 1 on host-b (pid 4242) killed by SIGKILL; 1 other rank here stopped after it`."""
    from store.services import how

    after = f"; {others} other rank{'s' if others > 1 else ''} here stopped after it" if others else ""
    return f"rank {rank} on {socket.gethostname()} (pid {pid}) {how(code)}{after}"


if __name__ == "__main__":
    main()
