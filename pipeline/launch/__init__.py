"""Process control: the ``pipeline-train`` command line (cli), the local supervisor that runs the
learner and the producers as processes on one machine (local), and shared-memory reclaim (shm)."""
