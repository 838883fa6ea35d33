"""Python code run in a forked child of the test process: the engine and torch are imported already, so a child
starts in milliseconds where a fresh interpreter takes seconds (tens on a busy machine)."""
import os
import sys
import tempfile
import time
import traceback


def run_forked_with_output(code: str, timeout_s: float = 300) -> tuple:
    """run_forked, and what the child printed: (exit status, its standard output)."""
    with tempfile.TemporaryFile("w+") as output:
        status = run_forked(code, timeout_s, output.fileno())
        output.seek(0)
        return status, output.read()


def run_forked(code: str, timeout_s: float = 300, stdout_fd: int = -1) -> int:
    """Runs `code` in a forked child and returns its exit status (0 when the code ends, 1 on an exception, or what
    it passed to os._exit); its standard output goes to `stdout_fd` when given. The child runs torch
    single-threaded (an OpenMP pool the parent started hangs a forked child that uses it) and leaves with
    os._exit: none of the parent's clean-up runs twice."""
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            if stdout_fd >= 0:
                os.dup2(stdout_fd, 1)
                sys.stdout = open(1, "w", closefd=False)
            import torch
            torch.set_num_threads(1)
            exec(compile(code, "<forked child>", "exec"), {"__name__": "__forked_child__"})
        except BaseException:   # noqa: BLE001 - the child reports and leaves, whatever happened
            traceback.print_exc()
            status = 1
        finally:
            sys.stdout.flush()
            os._exit(status)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise TimeoutError(f"the forked child ran past {timeout_s} s")
        time.sleep(0.02)
