"""What the end-to-end tests share and are not tests themselves: ways to run `pipeline-train`
(``train_run``, ``launcher``, ``ray_runs``), loopback Ray clusters (``ray_nodes``), and the user
code that runs inside those runs (rewards, episodes, a reward model, a rogue producer).

Imported as ``tests.e2e.support.<module>`` (the repository root is on the path: pytest's
``pythonpath``, and PYTHONPATH for the runs' processes and Ray nodes); runs name the user code as
``tests.e2e.support.<module>:<name>`` or by its file path.
"""
