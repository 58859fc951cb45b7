"""How far the learner's logprobs are from the engine's, per sampling setting, at lag 0.

    python -m bench.sampled_distribution [--model smollm2-135m|tiny|PATH] [--dtype float32]
        [--prompts 16] [--group-size 4] [--max-tokens 32] [--out FILE.md]

One real vLLM engine (built by ``pipeline.producer.engine.build_engine``: processed logprobs)
generates chat-templated arithmetic prompts under each setting; the learner (``PolicyTrainer``,
same weights, same dtype) then computes every sampled token's logprob three ways:
- replay: the distribution the engine sampled (logits / T, cut to the same top-k and top-p of
  the learner's own logits): what the project trains;
- tempered only: logits / T over the whole vocabulary, the truncation left to the importance
  weight (the alternative the issue weighed: its gap to the engine is the log of the kept mass,
  a bias every truncated token carries);
- raw: log_softmax(logits), what a trainer that ignores the sampling settings computes.
It prints one Markdown row per setting: mean and max |engine - replay|, mean |engine - tempered|,
mean |engine - raw|, and the share of sampled tokens the learner's own cut would have dropped
(the sampler's and the learner's numbers on opposite sides of the top-p/top-k boundary; the
learner keeps the sampled token there).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

SETTINGS = [  # (name, temperature, top_p, top_k)
    ("T 1.0", 1.0, 1.0, 0),
    ("T 0.7", 0.7, 1.0, 0),
    ("T 0.7, top-p 0.95", 0.7, 0.95, 0),
    ("T 0.7, top-p 0.9", 0.7, 0.9, 0),
    ("T 1.0, top-k 20", 1.0, 1.0, 20),
    ("T 1.3", 1.3, 1.0, 0),
]


def _cfg(model: str, dtype: str, group_size: int, max_tokens: int):
    from pipeline.config import load_config

    return load_config(None, {
        "model.path": model, "model.dtype": dtype, "engine.max_model_len": 512,
        "engine.gpu_memory_utilization": float(os.environ.get("GPU_MEM", "0.3")),
        "generation.group_size": group_size, "generation.max_tokens": max_tokens,
        "data.path": "arithmetic:2000:9", "data.chat_template": "auto",
        "run_dir": tempfile.mkdtemp(prefix="sampled-dist-")})


async def _generate(engine, prompts: list[list[int]], group_size: int, max_tokens: int,
                    temp: float, top_p: float, top_k: int):
    """G completions per prompt: (token ids, behaviour logprobs) each."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from pipeline.producer.group import sampled_logprobs
    from pipeline.producer.trained_sampling import engine_options

    sp = SamplingParams(n=1, logprobs=0, max_tokens=max_tokens, flat_logprobs=True,
                        detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
                        **engine_options(temp, top_p, top_k))

    async def one(rid: str, ids: list[int]):
        async for out in engine.generate({"prompt_token_ids": ids}, sp, rid):
            c = out.outputs[0]
        toks = list(c.token_ids)
        return toks, sampled_logprobs(c.logprobs, toks)

    tag = f"{temp}-{top_p}-{top_k}-{time.monotonic_ns()}"
    return await asyncio.gather(*(one(f"{tag}-{i}-{j}", p) for i, p in enumerate(prompts)
                                  for j in range(group_size)))


def _row(trainer, prompts, outs, group_size: int, dist: tuple[float, float, int]) -> dict:
    import numpy as np
    import torch

    from buffer.schema import Completion, RolloutGroup
    from pipeline.learner.batching import pack_groups
    from pipeline.learner.logprobs import device_batch, micro_batch_logprobs, truncate
    from pipeline.producer.trained_sampling import DEFAULT

    groups = []
    for i, p in enumerate(prompts):
        comps = [Completion(token_ids=np.asarray(t, dtype=np.int32),
                            logprobs=np.asarray(lp, dtype=np.float32), version_segments=[(0, 0)],
                            reward=float(j), sampling_segments=[] if dist == DEFAULT
                            else [(0, *dist)])
                 for j, (t, lp) in enumerate(outs[i * group_size:(i + 1) * group_size])]
        groups.append(RolloutGroup(group_id=f"g{i}", producer_id="p", prompt_id=str(i),
                                   prompt_token_ids=np.asarray(p, dtype=np.int32),
                                   completions=comps))
    pb = pack_groups(groups, True, 1e-6)
    rows = list(range(len(pb.sequences)))
    b, att = device_batch(pb, rows, False, trainer.pad_id, trainer.device)
    variants = {"replay": b, "tempered": {k: v for k, v in b.items()
                                           if k not in ("top_p", "top_k")},
                "raw": {k: v for k, v in b.items()
                        if k not in ("temperature", "top_p", "top_k")}}
    m = b["mask"]
    out = {"tokens": int(m.sum())}
    with torch.no_grad():
        for name, bb in variants.items():
            lp, _ = micro_batch_logprobs(trainer.policy, None, bb, att)
            gap = (lp - b["behaviour"]).abs()[m].double()
            out[name] = (float(gap.mean()), float(gap.max()))
        outside = 0
        if "top_p" in b:  # the learner's own cut, without keeping the sampled token
            logits = trainer.model(input_ids=b["input_ids"],
                                   attention_mask=b["attention_mask"]).logits[:, :-1]
            z = logits[b["select"]].float() / b["temperature"][m].unsqueeze(1)
            targets = b["input_ids"][:, 1:][b["select"]]
            best = z.argmax(-1)  # always kept: the cut without the sampled token's exception
            cut = truncate(z, best, b["top_p"][m], b["top_k"][m])
            outside = int(torch.isinf(cut.gather(1, targets[:, None])).sum())
        out["outside"] = outside
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    from pipeline.learner.trainer import PolicyTrainer
    from pipeline.models import resolve_model
    from pipeline.producer.data import load_records, render_prompt
    from pipeline.producer.engine import build_engine

    cfg = _cfg(a.model, a.dtype, a.group_size, a.max_tokens)
    path = str(resolve_model(cfg.model.path, Path(cfg.model.cache_dir)))
    trainer = PolicyTrainer(cfg, path)
    trainer.model.eval()
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(_build(build_engine, cfg, path))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    prompts = [render_prompt(tok, cfg.data, r["prompt"])
               for r in load_records(cfg.data.path)[:a.prompts]]
    lines = [f"model {a.model} ({a.dtype}), {a.prompts} prompts x {a.group_size} completions, "
             f"<= {a.max_tokens} tokens, lag 0", "",
             "| setting | tokens | engine - replay: mean (max) | engine - tempered only: mean "
             "| engine - raw: mean | outside the learner's cut |",
             "|---|---|---|---|---|---|"]
    try:
        for name, t, p, k in SETTINGS:
            outs = loop.run_until_complete(_generate(engine, prompts, a.group_size,
                                                     a.max_tokens, t, p, k))
            r = _row(trainer, prompts, outs, a.group_size, (t, p, k))
            lines.append(f"| {name} | {r['tokens']} | {r['replay'][0]:.2e} "
                         f"({r['replay'][1]:.2e}) | {r['tempered'][0]:.2e} | "
                         f"{r['raw'][0]:.2e} | {r['outside']} |")
            print(lines[-1], flush=True)
    finally:
        engine.shutdown()
        loop.close()
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


async def _build(build_engine, cfg, path):
    return build_engine(cfg.model, cfg.engine, path, cfg.engine.seed)


if __name__ == "__main__":
    main()
