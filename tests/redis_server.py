"""A throwaway redis-server (Debian's) on a free loopback port in a temporary directory, for the Redis backend's
tests and benchmarks. Where redis-server is missing the tests skip, unless CARNATOR_REQUIRE_ALL_TESTS=1 (CI),
where they fail: a CI run must exercise the shared store, not skip it."""
import os
import shutil
import socket
import subprocess
import time

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def require_redis_server():
    """Skips the calling test (or fails it under CARNATOR_REQUIRE_ALL_TESTS=1) when redis-server is missing."""
    import pytest
    if os.path.exists(REDIS_SERVER):
        return
    message = f"redis-server not found at {REDIS_SERVER}: apt-get install redis-server"
    if os.environ.get("CARNATOR_REQUIRE_ALL_TESTS") == "1":
        pytest.fail(message + " (CARNATOR_REQUIRE_ALL_TESTS=1: these tests must run)")
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    def __init__(self, directory: str, password: str = "", appendonly: bool = False):
        self.directory, self.password, self.appendonly = directory, password, appendonly
        self.port = free_port()
        self.process = None

    @property
    def url(self) -> str:
        """The URL without the password (tests pass it where they mean to)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        os.makedirs(self.directory, exist_ok=True)
        command = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.directory,
                   "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
                   "--protected-mode", "no", "--logfile", os.path.join(self.directory, "redis.log")]
        if self.password:
            command += ["--requirepass", self.password]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as connection:
                    connection.sendall(b"PING\r\n")
                    if connection.recv(64):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port} (see {self.directory}/redis.log)")

    def stop(self, kill: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            (self.process.kill if kill else self.process.terminate)()
            self.process.wait(timeout=20)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()
