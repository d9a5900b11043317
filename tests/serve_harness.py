"""`dint-serve` subprocesses on 127.0.0.1 for the tests and `bench/serve_load.py`: start (one or several at once), wait
until healthy, read what they printed, stop."""

import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import IO


@dataclass
class DintServer:
    """A `dint-serve` subprocess. Its stdout and stderr go to a temporary file (a pipe that nobody reads would block
    the server once its access log fills the pipe's buffer)."""

    process: subprocess.Popen
    base_url: str
    output_file: IO[str]

    def output(self) -> str:
        """Everything the server has printed so far."""
        self.output_file.flush()
        self.output_file.seek(0)
        return self.output_file.read()

    def wait_until_healthy(self, timeout: float = 180.0) -> "DintServer":
        """Waits until `/health` answers 200; raises with the server's output if it exits first or never answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"dint-serve exited with {self.process.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"dint-serve did not answer within {timeout} s:\n{self.output()}")

    def stop(self, timeout: float = 30.0) -> None:
        """Terminates the server (killed if it has not exited within `timeout` seconds)."""
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def launch_dint_serve(model: str, *flags: str, host: str = "127.0.0.1", port: int | None = None,
                      env: dict | None = None) -> DintServer:
    """Starts `dint-serve MODEL FLAGS...` (`python -m modeling_dint.integrations.serve_cli`), on a free port by
    default, without waiting for it: several servers can start at once, then each `wait_until_healthy()`."""
    if port is None:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    command = [sys.executable, "-m", "modeling_dint.integrations.serve_cli", model, "--host", host, "--port", str(port),
               *flags]
    output_file = tempfile.TemporaryFile("w+", encoding="utf-8")
    process = subprocess.Popen(command, env=env, stdout=output_file, stderr=subprocess.STDOUT, text=True)
    return DintServer(process, f"http://{host}:{port}", output_file)


def start_dint_serve(model: str, *flags: str, host: str = "127.0.0.1", port: int | None = None,
                     timeout: float = 180.0, env: dict | None = None) -> DintServer:
    """`launch_dint_serve(...).wait_until_healthy(timeout)`: a server that answers. Stop it with `stop()`."""
    return launch_dint_serve(model, *flags, host=host, port=port, env=env).wait_until_healthy(timeout)
