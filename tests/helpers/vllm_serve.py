"""``vllm serve`` as a user starts it, for the real-engine serve tests.

A :class:`Server` is one ``vllm serve`` process tree (the API server, vLLM's EngineCore
process and its worker process) in a session of its own, its output in a log file. The
README's ``--kv-transfer-config`` line is read from README.md itself, so the test serves
what the README tells users to serve. The tiny model gets a byte-level tokenizer of its
256-token vocabulary (one token per byte, nothing fetched), so prompts are plain text.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(os.path.dirname(os.path.dirname(HERE)), "README.md")

#: Hang guards (generous: the machine may be loaded): a server that is neither up nor dead
#: by then, or still running after a signal, fails its test instead of the run.
START_GUARD_S = 600.0
EXIT_GUARD_S = 120.0


def readme_serve_config() -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON of the README's ``vllm serve MODEL`` line for
    ``TritonOffloadingConnector``."""
    with open(README, encoding="utf-8") as f:
        for line in f:
            if line.startswith("vllm serve MODEL") and "TritonOffloadingConnector" in line:
                words = shlex.split(line)
                return json.loads(words[words.index("--kv-transfer-config") + 1])
    raise AssertionError(f"{README} has no `vllm serve MODEL ... TritonOffloadingConnector` line")


def write_byte_tokenizer(folder: str) -> None:
    """A byte-level BPE tokenizer without merges beside the model: token id = byte, so its
    256 ids are exactly the tiny models' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def logging_config(warnings_path: str) -> dict[str, Any]:
    """vLLM's own logging configuration plus one file that receives every WARNING or worse
    of this project's loggers (``vllm.triton_offload`` and ``triton_offload.*``) from every
    process; vLLM's output is unchanged."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["handlers"]["triton_offload_warnings"] = {
        "class": "logging.FileHandler",
        "filename": warnings_path,
        "formatter": "vllm",
        "level": "WARNING",
    }
    level = config["loggers"]["vllm"]["level"]
    for name in ("vllm.triton_offload", "triton_offload"):
        config["loggers"][name] = {
            "handlers": ["triton_offload_warnings"],
            "level": level,
            "propagate": True,
        }
    return config


class Server:
    """One ``vllm serve`` run: ``start`` it, wait until it answers (``wait_ready``) or
    exits (``wait_exit``), send it a signal; ``log()`` is everything it printed."""

    def __init__(self, root: str, name: str, args: list[str], env: dict[str, str]) -> None:
        self.log_path = os.path.join(root, f"{name}.log")
        self.warnings_path = os.path.join(root, f"{name}.warnings.log")
        self.port = free_port()
        self.args = [
            os.path.join(os.path.dirname(sys.executable), "vllm"),
            "serve",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        config_path = os.path.join(root, f"{name}.logging.json")
        with open(config_path, "w") as f:
            json.dump(logging_config(self.warnings_path), f)
        self.env = {**env, "VLLM_LOGGING_CONFIG_PATH": config_path}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        with open(self.log_path, "wb") as log:
            # A session of its own: Ctrl-C's SIGINT goes to its process group, and a
            # failed test can end the whole tree.
            self.process = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        return self

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def project_warnings(self) -> str:
        if not os.path.exists(self.warnings_path):
            return ""
        with open(self.warnings_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def get(self, path: str, method: str = "GET") -> tuple[int, str]:
        request = urllib.request.Request(self.url + path, method=method)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def wait_ready(self) -> None:
        """Until ``/health`` answers 200; AssertionError with the log's end if the server
        exits first or the hang guard runs out."""
        assert self.process is not None
        deadline = time.monotonic() + START_GUARD_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"vllm serve exited with {self.process.returncode} before it was ready; "
                    f"its log ends:\n{self.log()[-6000:]}"
                )
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        raise AssertionError(
            f"vllm serve was not ready within {START_GUARD_S:.0f} s (hang guard); its log "
            f"ends:\n{self.log()[-6000:]}"
        )

    def wait_exit(self) -> int:
        """The exit status; AssertionError if it still runs after the hang guard."""
        assert self.process is not None
        try:
            return self.process.wait(timeout=EXIT_GUARD_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"vllm serve still runs {EXIT_GUARD_S:.0f} s after its signal (hang guard); "
                f"its log ends:\n{self.log()[-6000:]}"
            ) from None

    def interrupt(self) -> None:
        """Ctrl-C in the terminal that started it: SIGINT to its whole process group."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGINT)

    def terminate(self) -> None:
        """What a service manager or ``docker stop`` does: SIGTERM to the server's pid."""
        assert self.process is not None
        self.process.terminate()

    def kill_tree(self) -> None:
        """End whatever is left of the tree (a test that failed half-way)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def child_pids(self) -> list[int]:
        """The EngineCore and worker processes, as vLLM's log names them."""
        pattern = r"\((?:EngineCore|Worker|VllmWorker-\d+)(?:_DP\d+)? pid=(\d+)\)"
        return sorted({int(pid) for pid in re.findall(pattern, self.log())})

    def engine_id(self) -> str:
        match = re.search(r"Creating v1 connector with name: \S+ and engine_id: (\S+)", self.log())
        assert match, "no connector was created (no engine_id in the log)"
        return match.group(1)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie waiting to be reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


__all__ = [
    "Server",
    "alive",
    "free_port",
    "logging_config",
    "readme_serve_config",
    "write_byte_tokenizer",
]
