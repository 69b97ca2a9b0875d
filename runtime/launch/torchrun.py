"""`torchrun` whose rendezvous store listens on --master-addr alone (what `dsv4 node start` runs).

On node 0, torchrun's agent hosts the store every rank of the service joins (a TCPStore, torchrun's
"static" rendezvous); left to itself it listens on every interface (`*:PORT`), whatever address
--master-addr names. This is torchrun with one change: on node 0 that store is made first,
listening on the master address only (`runtime.launch.rank_store.bound_store`), as a
multi-tenant server, which torchrun's own multi-tenant store of the same port then shares.
Everything else — the arguments, the agent, its workers — is torchrun's (`torch.distributed.run`).

    python -m runtime.launch.torchrun <torchrun's arguments>
"""

from __future__ import annotations

import sys

STORE_TIMEOUT_S = 900.0  # torchrun's static rendezvous default


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run

    args = run.parse_args(list(sys.argv[1:] if argv is None else argv))
    store = None
    if args.rdzv_backend == "static" and args.node_rank == 0:
        from runtime.launch.rank_store import bound_store

        store = bound_store(args.master_addr, args.master_port, STORE_TIMEOUT_S, multi_tenant=True)
    try:
        run.run(args)
    finally:
        del store  # held until the agent is done: torchrun's store is this one


if __name__ == "__main__":
    main()
