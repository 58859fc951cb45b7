"""Tensor parallelism with the NCCL weight route on real vLLM (0.25.1 on the device tool), checked
by effect.

The engine runs with ``tensor_parallel_size=2`` on GPUs 0 and 1; this test process plays the
learner, the nccl route's learner end (``sync.routes.nccl.NcclLearnerEnd``) on GPU 2. The link
is one NCCL group of 1 + 2 ranks: the learner is rank 0, TP worker r joins as 1 + r. Two
versions (different perturbations of the tiny model) are published and swapped in over NCCL
under load; after each, the engine's greedy tokens and their logprobs for a fixed prompt must
match the learner's own (``token_logprobs`` of an fp32 HF model holding the same weights, on
GPU 2) and differ from the previous version's. Each TP worker holds half of every sharded
matrix (attention heads, MLP, the vocabulary of embedding and head), so a worker left on the old
weights would make the logprobs mismatch: matching the learner shows that both ranks received
and applied the version.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import assert_no_children
from test_gpu_transports import PID, Learner, _gpus, _publish, _swap_under_load

from bench.sync_bench import model_tensors, perturbed
from pipeline.learner.logprobs import token_logprobs
from sync.barrier import RequestTracker
from sync.routes import plan_route
from sync.routes.nccl import NcclRoute, nccl_offer
from tests.e2e.support.engine_loop import PROBE, EngineLoop, probe

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(_gpus() < 3, reason="needs 3 GPUs: a TP=2 engine on GPUs 0-1 "
                                                     "and the learner on GPU 2")]
LEARNER_GPU = "cuda:2"
# Per-token logprobs, engine (bf16) vs learner (fp32 from the same bf16 weights). On this model
# bf16 and fp32 differ by < 0.005 and the versions by ~0.5 (mean over the probe's tokens).
TOL = 0.05


@pytest.fixture(scope="module")
def weights(tiny_model, tmp_path_factory):
    """The checkpoint's weights, two different perturbations of them, and a directory for the
    snapshot files (each version's rollback target and fallback)."""
    base = model_tensors(tiny_model)
    return {"base": base, "v1": perturbed(base, scale=0.5, seed=1),
            "v2": perturbed(base, scale=0.5, seed=2), "dir": tmp_path_factory.mktemp("gpu-tp")}


@pytest.fixture(scope="module")
def eng(tiny_model):
    e = EngineLoop(tiny_model, tensor_parallel_size=2)
    e.tracker = RequestTracker()
    yield e
    e.close()
    assert_no_children()


@pytest.fixture(scope="module")
def policy(tiny_model):
    """The learner's model: fp32 like the trainer's, on the learner's GPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32
                                                ).to(LEARNER_GPU).eval()


def learner_view(model, tensors: dict, tokens: list[int]) -> tuple[list[float], list[float]]:
    """With ``tensors`` loaded: the learner's logprob of each of the engine's greedy ``tokens``
    after PROBE, and how far each falls below the learner's most likely token there (0 where
    the engine picked the learner's argmax)."""
    model.load_state_dict(tensors)
    ids = torch.tensor([PROBE + tokens], device=LEARNER_GPU)
    attn = torch.ones_like(ids)
    mask = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool, device=LEARNER_GPU)
    mask[0, len(PROBE) - 1:] = True
    with torch.no_grad():
        lp = token_logprobs(model, ids, attn, mask)[mask]
        logits = model(input_ids=ids, attention_mask=attn).logits[0, len(PROBE) - 1:-1]
        best = torch.log_softmax(logits.float(), dim=-1).max(dim=-1).values
    return lp.tolist(), (best - lp).tolist()


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def _link_up(learner: Learner, nccl: NcclRoute, offer: dict) -> None:
    await nccl.join(offer)
    await asyncio.gather(*learner.tasks)


async def _settled(learner: Learner) -> None:
    await asyncio.gather(*learner.tasks)  # the learner's side of each send has returned


def test_tp2_engine_takes_each_version_over_nccl_on_both_ranks(eng, weights, policy):
    learner = Learner(LEARNER_GPU, timeout_s=60.0)
    try:
        devices = eng.run(eng.engine.collective_rpc("sync_device_info"))
        assert sorted(d["rank"] for d in devices) == [0, 1], devices
        my_gpus = [d["gpu_uuid"] for d in devices]
        assert len(set(my_gpus)) == 2 and learner.copies.gpu_uuid not in my_gpus, \
            f"TP workers on {my_gpus}, learner on {learner.copies.gpu_uuid}"

        # World size as the learner's announce loop computes it: 1 + one rank per worker.
        learner.nccl.maintain({PID: (True, 1 + len(devices))})
        offer = nccl_offer(learner.nccl.offer(0, [PID]), PID)
        assert offer is not None and offer["world_size"] == 3 and offer["rank_offset"] == 1
        nccl = NcclRoute(eng.engine, learner.send_ready, timeout_s=60.0)
        eng.run(_link_up(learner, nccl, offer), timeout=180)
        assert learner.nccl.links[PID].state == "ready" and nccl.joined == offer["unique_id"]

        prev = None  # (weights name, engine tokens, engine logprobs) of the previous version
        for sends, which in enumerate(("base", "v1", "v2")):
            if which != "base":  # base: the checkpoint the engine started from
                v = eng.next_version()
                ref, transfer = _publish(learner, weights, which, v, "nccl")
                assert plan_route("nccl", transfer, PID, my_gpus, nccl.joined) == ("nccl", "")
                report = eng.run(_swap_under_load(eng, "nccl", ref, transfer, nccl),
                                 timeout=600)
                assert report.ok and "fallback" not in report.timings, report.error
                assert "nccl_s" in report.timings and report.timings.get("load_bytes", 0) > 0, \
                    f"v{v} did not come over NCCL: {report.timings}"
                eng.run(_settled(learner), timeout=120)
                assert (learner.nccl.sends, learner.nccl.send_failures) == (sends, 0)
                print(f"\ntp2 nccl v{v}: idle {report.timings['idle_s']:.3f}s load "
                      f"{report.timings['load_s']:.3f}s")
            tokens, got = eng.run(probe(eng.engine, eng.tracker))
            want, below_best = learner_view(policy, weights[which], tokens)
            assert max_diff(got, want) < TOL, \
                f"{which}: engine logprobs {got} vs the learner's {want}"
            assert max(below_best) < TOL, \
                f"{which}: a greedy token of the engine is not the learner's argmax: {below_best}"
            if prev is not None:
                p_which, p_tokens, p_got = prev
                assert tokens != p_tokens or max_diff(got, p_got) > 3 * TOL, \
                    f"{which}: the engine's output did not change from {p_which}"
                stale, _ = learner_view(policy, weights[p_which], tokens)
                assert max_diff(got, stale) > 3 * TOL, \
                    f"{which}: TOL cannot tell {which} from {p_which} on these tokens"
            prev = (which, tokens, got)
    finally:
        learner.close()
