"""torchrun itself (torch.distributed.run's main), its workers forked from a server that imported lightning and
the tests' modules once: run it with ``--run-path --start-method forkserver`` (see dist.torchrun). A worker then
costs a fork, not a ~4 s import; the agent, its rendezvous and its restarts are torchrun's own."""

import multiprocessing
import os

if __name__ == "__main__":  # (the workers import this file as __mp_main__)
    from torch.distributed.run import main

    os.environ["LTP_TEST_AGENT_PID"] = str(os.getpid())  # the workers' agent (their parent is the fork server)
    multiprocessing.set_forkserver_preload(["torch", "lightning", "lightning_tp", "dist", "models"])
    main()
