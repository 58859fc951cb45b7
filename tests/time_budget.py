"""The suite's time budget: every test has one, and a run that goes over it fails.

Why: CI has 90 minutes and the suite must stay within 30 of them. A test's time is its setup,
call and teardown together (a module fixture's start-up counts for the test that first needs
it). Budgets are about twice a test's time on an idle 2-core machine, so they catch a test that
grew, never a busy moment: an end-to-end test (tests/e2e) gets ``E2E_S`` (one launcher run with
one engine takes 45-65 s on 2 cores), a unit test ``UNIT_S``, and the tests that need more are
listed in ``OVER`` with their own budget and the reason.

Under pytest-xdist (``scripts/test.sh`` runs two workers) each budget is multiplied by the
number of workers: two tests then share the two cores.

Wall time alone would fail a run by noise: a unit test beside an end-to-end test's four
processes, or on a host slower that day, takes several times its idle time without doing more.
So a test over its wall budget fails only if its CPU seconds (the test process and every child
it reaped) are over the budget too, i.e. it does more work than budgeted, or its wall time is
over ``HARD`` times the budget (a test that grew by waiting). CPU seconds are not counted where
they were not reaped (a Ray cluster's daemons), which only makes the check more lenient.

``pytest --no-time-budget`` reports overruns without failing (a developer's loaded laptop).
"""

from __future__ import annotations

from dataclasses import dataclass

E2E_S = 120.0
UNIT_S = 5.0
HARD = 3.0
"""Over this many times its (shared) wall budget a test fails whatever its CPU seconds."""

# Test (file::function, parameters ignored) -> (budget in seconds, why it needs more).
OVER: dict[str, tuple[float, str]] = {
    "tests/e2e/test_elastic.py::test_a_producer_joins_and_another_leaves_nothing_lost": (
        600, "a join (a second engine), a leave, shared evaluation, and under the local launcher "
             "a kill -9 of the learner and its restart"),
    "tests/e2e/test_zero_run.py::test_zero3_learner_buckets_checkpoint_eval_and_resume": (
        420, "three launches of a 2-rank DeepSpeed learner beside an engine: the run, "
             "pipeline-train eval of its checkpoint, the resumed run"),
    "tests/e2e/test_ray_driver.py::"
    "test_driver_killed_leaves_nothing_running_and_resume_finishes_the_run": (
        330, "two drivers, each starting a private Ray node and two engines"),
    "tests/e2e/test_ray_spare_node.py::"
    "test_lost_producer_moves_to_the_spare_node_and_resends_its_outbox": (
        330, "a Ray cluster of its own and a producer engine started again on the spare node"),
    "tests/e2e/test_ray.py::test_three_nodes_placement_streamed_weights_and_producer_kill": (
        300, "starts the module's 3-node Ray cluster and three producer engines (one restarted)"),
    "tests/e2e/test_bench_producer.py::test_bench_producer_prints_rates_and_ratios": (
        210, "two engines (offline LLM and AsyncLLM) and five timed request shapes"),
    "tests/e2e/test_reward_actors.py::test_reward_replicas_shared_and_one_killed_mid_call": (
        240, "starts the module's Ray cluster, reward replicas and two engines"),
    "tests/e2e/test_gpu_deepspeed.py::test_pipeline_train_two_gpu_learner_then_resume": (
        330, "GPU machine: a run and its resume, each starting a 2-rank learner and a CUDA "
             "engine with its graphs (135-175 s on two H200s)"),
    "tests/e2e/test_gpu_transports.py::test_pipeline_train_split_layout_routes_weights_by_nccl": (
        240, "GPU machine: a CUDA engine with its graphs and a learner on the other GPU, linked "
             "by an NCCL group (104 s on two H200s, over 120 s on a machine's first call)"),
    "tests/e2e/test_faults.py::test_producer_killed_is_restarted_and_run_completes": (
        210, "the killed producer's engine starts again"),
    "tests/e2e/test_faults.py::test_learner_killed_stops_everything_then_resume_continues": (
        210, "a run and its resume: two engine starts"),
    "tests/e2e/test_eval.py::test_eval_during_training_and_of_a_checkpoint": (
        210, "a run, then pipeline-train eval of its checkpoint: two engine starts"),
    "tests/e2e/test_eval_checkpoints.py::test_eval_of_a_lora_checkpoint_matches_training": (
        210, "a run, then pipeline-train eval of its checkpoint: two engine starts"),
    "tests/e2e/test_ray.py::test_learner_killed_is_restarted_from_its_checkpoint": (
        180, "two producer engines and the learner restarted by Ray"),
    "tests/e2e/test_ray.py::test_worker_node_lost_run_goes_on": (
        180, "two producer engines, one lost with its node"),
    "tests/e2e/test_shm_reclaim.py::"
    "test_leftovers_of_a_killed_launcher_are_reclaimed_by_the_next_run": (
        300, "two runs: a launcher killed with everything it started, then one that reclaims"),
    "tests/e2e/test_sync_drain.py::"
    "test_drain_waits_only_for_prefills_under_way_and_no_kv_crosses_versions": (
        180, "an engine of its own and a backlog of long prompts queued at the swap"),
    "tests/e2e/test_sync_final_mode.py::test_final_mode_swap_tags_tokens_by_effect": (
        180, "the module's engine (the first mode starts it), 24 requests of 160 tokens across a "
             "swap"),
    # Unit tests that start a process or an engine, or draw many examples.
    "tests/unit/pipeline/test_models.py::test_convert_smollm2_and_generate": (
        360, "converts the GGUF SmolLM2-135M and generates with a vLLM engine"),
    "tests/unit/pipeline/learner/test_checkpoint_background.py::"
    "test_kill_9_during_the_background_write_keeps_the_previous_checkpoint": (
        150, "a child process writing a checkpoint, killed -9 mid-write, then read back"),
    "tests/unit/pipeline/launch/test_cli_validation.py::"
    "test_random_values_for_every_option_exit_2_or_build_a_sound_config": (
        40, "hypothesis: random values for every option"),
    "tests/unit/pipeline/producer/test_data_formats.py::test_cli_exits_2_with_one_line": (
        30, "pipeline-train in a subprocess"),
    "tests/unit/pipeline/launch/test_cli.py::test_bad_config_fails_fast_with_one_message": (
        20, "pipeline-train in a subprocess"),
    "tests/unit/pipeline/test_memory.py::"
    "test_pipeline_train_refuses_in_one_line_before_anything_starts": (
        30, "pipeline-train in a subprocess"),
    "tests/unit/pipeline/learner/test_checkpoint.py::"
    "test_the_estimate_from_the_config_is_the_checkpoint_written": (
        30, "builds a model and an AdamW state, writes and sizes the checkpoint"),
    "tests/unit/pipeline/learner/test_trainer.py::"
    "test_packed_token_budget_step_equals_padded_rows": (
        15, "two optimiser steps of the tiny model per loss mode"),
    "tests/unit/pipeline/learner/test_oom_retry.py::"
    "test_injected_oom_retries_the_same_batch_in_one_line": (
        20, "builds the tiny model's trainer (module fixture), then three optimiser steps"),
    "tests/unit/pipeline/learner/test_logprobs_of_the_sampled_distribution.py::"
    "test_the_learners_logprobs_are_of_each_tokens_distribution": (
        12, "builds a small Llama (the first case imports transformers) and recomputes every "
            "token's distribution in numpy"),
    "tests/unit/buffer/test_buffer_schema.py::test_property_any_valid_group_round_trips": (
        15, "hypothesis: many random groups"),
    "tests/unit/bench/test_gpu_bench.py::test_run_group_timeout_stops_the_whole_process_group": (
        15, "waits for a process group's timeout"),
    "tests/unit/pipeline/learner/test_trackers.py::test_wandb_offline_scalars_land": (
        15, "wandb's offline service process, which the test reaps: 1.0 CPU-s alone, 7.3 beside "
            "end-to-end tests on a slow host"),
}


@dataclass(frozen=True)
class Overrun:
    """A test over its wall budget (``budget_s``, already shared by the tests running at once);
    ``fails``: it fails the run (CPU seconds over the budget too, unknown, or ``HARD`` times
    over), else it was slowed by the machine and is only reported."""
    nodeid: str
    took_s: float
    budget_s: float
    cpu_s: float | None = None
    fails: bool = True


def _base(nodeid: str) -> str:
    """The test's name without parameters or pytest-xdist's ``@group`` suffix."""
    return nodeid.split("@", 1)[0].split("[", 1)[0]


def budget_for(nodeid: str) -> float:
    """The budget of a test by its pytest node id (``tests/e2e/test_x.py::test_y[param]``)."""
    listed = OVER.get(_base(nodeid))
    if listed is not None:
        return listed[0]
    return E2E_S if nodeid.startswith("tests/e2e/") else UNIT_S


def over_wall_budget(durations: dict[str, float], share: int = 1,
                     cpu: dict[str, float] | None = None) -> list[Overrun]:
    """The tests whose wall time is over their budget times ``share`` (how many tests ran at
    once, pytest-xdist's workers, each getting a part of the cores), slowest first. Each fails
    unless ``cpu`` has its CPU seconds and they are within the budget, and its wall time is
    within ``HARD`` times the shared budget."""
    cpu = cpu or {}
    over = []
    for n, took in durations.items():
        wall = budget_for(n) * share
        if took > wall:
            used = cpu.get(n)
            fails = took > wall * HARD or used is None or used > budget_for(n)
            over.append(Overrun(n, took, wall, used, fails))
    return sorted(over, key=lambda o: -o.took_s)


def overruns(durations: dict[str, float], share: int = 1,
             cpu: dict[str, float] | None = None) -> list[Overrun]:
    """The tests that fail the run's budget, slowest first."""
    return [o for o in over_wall_budget(durations, share, cpu) if o.fails]


def slowed(durations: dict[str, float], share: int, cpu: dict[str, float]) -> list[Overrun]:
    """The tests over their wall budget that do not fail it: their CPU seconds were within the
    budget (the machine was slow, the test did not grow). Reported, never failing."""
    return [o for o in over_wall_budget(durations, share, cpu) if not o.fails]


def stale_entries(nodeids: set[str]) -> list[str]:
    """Entries of ``OVER`` that name no collected test (a renamed or merged test)."""
    bases = {_base(n) for n in nodeids}
    return sorted(k for k in OVER if k not in bases)
